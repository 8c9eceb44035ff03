"""Logprobs and prompt logprobs against log_softmax of transformers' logits (float32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core.errors import ValidationError
from quire.offline import LLM, SamplingParams
from tests.core.reference import hf_logits

TOP = 5


@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16])  # whole prompt, or chunks of 16
def test_sample_and_prompt_logprobs_equal_transformers(llama_checkpoint, model, corpus_token_ids,
                                                        max_num_batched_tokens):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=512,
              max_num_batched_tokens=max_num_batched_tokens)
    prompt = corpus_token_ids[300:370]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=TOP,
                            prompt_logprobs=TOP)
    out, = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    reference = hf_logits(model, prompt + completion.token_ids).log_softmax(-1)

    assert len(completion.logprobs) == len(completion.token_ids) == 10
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[len(prompt) - 1 + step]
        assert position[token].rank == 1  # greedy picks the most likely token
        top = expected.topk(TOP)
        assert set(position) == set(top.indices.tolist())
        for token_id, logprob in position.items():
            assert abs(logprob.logprob - expected[token_id].item()) < 1e-4
    cumulative = sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(cumulative)

    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        position, expected = out.prompt_logprobs[j], reference[j - 1]
        assert abs(position[prompt[j]].logprob - expected[prompt[j]].item()) < 1e-4
        assert position[prompt[j]].rank == int((expected > expected[prompt[j]]).sum()) + 1
        assert set(expected.topk(TOP).indices.tolist()) <= set(position)


def test_sampled_token_logprob_and_rank_when_not_the_top_token(llama_checkpoint, model, corpus_token_ids):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=512)
    prompt = corpus_token_ids[:30]
    params = SamplingParams(temperature=3.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    reference = hf_logits(model, prompt + completion.token_ids).log_softmax(-1)
    ranks = []
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[len(prompt) - 1 + step]
        assert abs(position[token].logprob - expected[token].item()) < 1e-4  # raw, not tempered
        ranks.append(position[token].rank)
        assert position[token].rank == int((expected > expected[token]).sum()) + 1
        assert len(position) in (2, 3)
    assert max(ranks) > 1, "a hot temperature should pick a non-top token somewhere"


def test_logprobs_are_limited_by_max_logprobs(llama_checkpoint):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=128, max_logprobs=3)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValidationError, match="max_logprobs=3") as info:
            llm.generate("x", SamplingParams(**{field: 4}), use_tqdm=False)
        assert info.value.param == field
    assert llm.generate("x", SamplingParams(logprobs=3, max_tokens=2), use_tqdm=False)[0].finished
