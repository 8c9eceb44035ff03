"""n, priorities, metrics, prompt truncation and special-token handling, end to end."""

import pytest

from quire.core.engine.detokenizer import IncrementalDetokenizer
from quire.core.errors import ValidationError
from quire.offline import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=512)


def sampled(n=1, seed=7, **params):
    return SamplingParams(n=n, seed=seed, temperature=1.2, max_tokens=12, ignore_eos=True, **params)


def test_n_completions_are_seeded_seed_plus_index_and_batch_independent(llm, corpus_token_ids):
    prompt = corpus_token_ids[:40]
    out, = llm.generate([prompt], sampled(n=4), use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    completions = [c.token_ids for c in out.outputs]
    assert len({tuple(c) for c in completions}) > 1
    again, = llm.generate([prompt], sampled(n=4), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == completions
    others = [corpus_token_ids[100 + 30 * i:130 + 30 * i] for i in range(3)]
    mixed = llm.generate(others + [prompt], [sampled(seed=1), sampled(n=2, seed=50), sampled(seed=None),
                                             sampled(n=4)], use_tqdm=False)
    assert [c.token_ids for c in mixed[-1].outputs] == completions
    for i in range(4):
        single, = llm.generate([prompt], sampled(seed=7 + i), use_tqdm=False)
        assert single.outputs[0].token_ids == completions[i]


def test_n_streams_children_under_the_parent_id(llm):
    engine = llm.llm_engine
    engine.add_request("parent", "import os", SamplingParams(n=3, temperature=1.0, max_tokens=4,
                                                             ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert {o.request_id for o in seen} == {"parent"}
    assert {o.outputs[0].index for o in seen} == {0, 1, 2}
    assert [o.finished for o in seen].count(True) == 1 and seen[-1].finished
    with pytest.raises(ValidationError, match="greedy"):
        SamplingParams(n=2, temperature=0)


def test_abort_of_a_parent_aborts_its_children(llm):
    engine = llm.llm_engine
    engine.add_request("p", "x", SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(["p"])
    assert not engine.has_unfinished_requests()
    engine.step()
    assert engine.engine_core.engine_core.scheduler.requests == {}


def test_priority_lower_value_submitted_later_finishes_first(llama_checkpoint):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=256, max_num_seqs=1,
              scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, second = llm.generate(["first in", "second in"], params, priority=[5, 0], use_tqdm=False)
    assert second.metrics.finished_time < first.metrics.first_scheduled_time


def test_metrics_record_timings_and_statistics(llm, corpus_token_ids):
    prompt = corpus_token_ids[:64]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    out, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.finished_time and len(metrics.token_times) == 5
    assert metrics.time_to_first_token > 0 and metrics.e2e_latency >= metrics.time_to_first_token
    assert metrics.num_prompt_tokens == 64 and metrics.num_generation_tokens == 5
    assert metrics.num_cached_tokens == out.num_cached_tokens == 48
    engine_metrics = llm.get_metrics()
    assert engine_metrics.finished_requests[-1] is metrics
    stats = engine_metrics.scheduler
    assert stats.num_running_reqs == 0 and stats.prefix_cache_hits >= 48 and 0 <= stats.kv_cache_usage <= 1


def test_preemptions_are_counted_per_request(llama_checkpoint, corpus_token_ids):
    from quire.core.config import ModelConfig

    bytes_per_block = ModelConfig.from_hf(llama_checkpoint, "float32").kv_bytes_per_token * 16
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=128,
              kv_cache_memory=bytes_per_block * 9, enable_prefix_caching=False)
    prompts = [corpus_token_ids[i * 50:i * 50 + 30] for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                           use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) == llm.get_metrics().scheduler.num_preemptions > 0


def test_truncate_prompt_tokens_keeps_the_tail(llm, corpus_token_ids):
    prompt = corpus_token_ids[:100]
    params = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=20)
    out, = llm.generate([prompt], params, use_tqdm=False)
    assert out.prompt_token_ids == prompt[-20:]
    plain, = llm.generate([prompt[-20:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValidationError) as info:
        SamplingParams(truncate_prompt_tokens=0)
    assert info.value.param == "truncate_prompt_tokens"


def test_skip_special_tokens(llm):
    tokenizer = llm.get_tokenizer()
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = dict(temperature=0, max_tokens=3, allowed_token_ids=[special])
    kept, = llm.generate("x", SamplingParams(skip_special_tokens=False, **params), use_tqdm=False)
    dropped, = llm.generate("x", SamplingParams(**params), use_tqdm=False)
    assert kept.outputs[0].text == "<|im_start|>" * 3 and dropped.outputs[0].text == ""
    assert kept.outputs[0].token_ids == dropped.outputs[0].token_ids == [special] * 3


def test_spaces_between_special_tokens_with_a_space_joining_decoder():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "[X]": 3, "[Y]": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # joins tokens with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        additional_special_tokens=["[X]", "[Y]"])
    ids = [1, 3, 4, 2]

    def stream(**params):
        detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False, **params))
        text = ""
        for token_id in ids:
            detok.update([token_id], stop_terminated=False)
            text += detok.next_text(finished=False, delta=True)
        return text

    assert stream() == " a [X] [Y] b"
    assert stream(spaces_between_special_tokens=False) == " a [X][Y] b"
