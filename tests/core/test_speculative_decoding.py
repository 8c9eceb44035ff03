"""Speculative decoding with n-gram proposals, end to end: greedy ids equal those without speculation on 20
prompts of the tiny checkpoints in float32 (margin rule: equal up to a step whose reference margin is a
near-tie, 90% of the steps compared), one at a time and batched; proposals are accepted on
repetitive prompts and the counts add up; seeded random sampling stays reproducible."""

import pytest

from quire.core import SamplingParams
from quire.offline import LLM
from tests.gguf.greedy import assert_greedy_agrees

NUM_PROMPTS = 20
NUM_NEW_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    """Half repeat a passage (so that its continuation can be looked up), half do not."""
    result = []
    for i in range(NUM_PROMPTS):
        passage = corpus_token_ids[i * 311:i * 311 + 8 + i]
        result.append(passage * 3 if i % 2 == 0 else passage)
    return result


def greedy_reference(path, prompts):
    """Per prompt: ids without speculation, and the top-1 minus top-2 logprob at each step (for the margin
    rule of ``tests.gguf.greedy``)."""
    llm = LLM(path, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    reference = []
    for output in outputs:
        tops = [sorted((entry.logprob for entry in position.values()), reverse=True)
                for position in output.outputs[0].logprobs]
        reference.append((output.outputs[0].token_ids, [top[0] - top[1] for top in tops]))
    return reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_ids_equal_those_without_speculation(tiny_checkpoint, prompts, arch):
    path = tiny_checkpoint(arch)
    reference = greedy_reference(path, prompts)
    llm = LLM(path, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    batched = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in prompts]
    counts = llm.llm_engine.engine_core.engine_core.scheduler.spec_decode_counts
    llm.shutdown()
    assert_greedy_agrees(batched, reference, prompts, NUM_NEW_TOKENS)
    assert_greedy_agrees(alone, reference, prompts, NUM_NEW_TOKENS)
    assert counts.num_accepted_tokens > 0, "no proposal was ever accepted"
    assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
    assert counts.num_draft_tokens <= 4 * counts.num_drafts


def test_seeded_random_sampling_is_reproducible(tiny_checkpoint, prompts):
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, seed=7)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:6], params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:6]]
    llm.shutdown()
    assert first == alone
    assert all(len(ids) == NUM_NEW_TOKENS for ids in first)
