"""Prefix caching end to end: same tokens with and without it, and what it reports."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.offline import LLM, SamplingParams
from tests.core.reference import reference_greedy


@pytest.fixture(scope="module")
def shared_prompts(corpus_token_ids):
    prefix = corpus_token_ids[:200]
    return [prefix + corpus_token_ids[1000 + 40 * i:1000 + 40 * i + 5 + i] for i in range(4)]


def greedy(n=12):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_outputs_are_identical_with_caching_on_and_off_and_equal_transformers(
        llama_checkpoint, shared_prompts):
    cached = LLM(llama_checkpoint, dtype="float32", max_model_len=512)
    uncached = LLM(llama_checkpoint, dtype="float32", max_model_len=512, enable_prefix_caching=False)
    # cold: the requests of one step share blocks the first of them is computing in that same step
    cold = cached.generate(shared_prompts, greedy(), use_tqdm=False)
    assert [o.num_cached_tokens for o in cold] == [0, 192, 192, 192]
    on = token_ids(cached.generate(shared_prompts, greedy(), use_tqdm=False))  # warm: earlier steps
    off = token_ids(uncached.generate(shared_prompts, greedy(), use_tqdm=False))
    assert on == off == token_ids(cold)
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    assert on == [reference_greedy(model, p, 12) for p in shared_prompts]
    stats = cached.get_metrics().scheduler
    assert stats.prefix_cache_hits >= 7 * 192
    assert uncached.get_metrics().scheduler.prefix_cache_hits == 0


def test_a_second_request_sharing_a_200_token_prefix_reports_cached_tokens(llama_checkpoint,
                                                                           shared_prompts):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=512)
    first, = llm.generate(shared_prompts[0], greedy(2), use_tqdm=False)
    second, = llm.generate(shared_prompts[1], greedy(2), use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 192
    together = llm.generate(shared_prompts[2:], greedy(2), use_tqdm=False)
    assert all(o.num_cached_tokens >= 192 for o in together)


def test_reset_prefix_cache(llama_checkpoint, shared_prompts):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=512)
    llm.generate(shared_prompts[0], greedy(2), use_tqdm=False)
    assert llm.reset_prefix_cache()
    again, = llm.generate(shared_prompts[0], greedy(2), use_tqdm=False)
    assert again.num_cached_tokens == 0


def test_cache_salt_isolates_requests(llama_checkpoint, shared_prompts):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=512)
    engine = llm.llm_engine
    for request_id, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        engine.add_request(request_id, shared_prompts[0], greedy(1), cache_salt=salt)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].num_cached_tokens == (192 if request_id == "c" else 0)
