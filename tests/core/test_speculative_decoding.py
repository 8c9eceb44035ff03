"""Speculative decoding with n-gram proposals, end to end: greedy ids equal those without speculation on 20
prompts of the tiny checkpoints in float32 (margin rule: up to each prompt's first near-tie), one at a time
and batched; proposals are accepted on
repetitive prompts and the counts add up; seeded random sampling stays reproducible."""

import pytest

from quire.core import SamplingParams
from quire.offline import LLM

NUM_PROMPTS = 20
NUM_NEW_TOKENS = 24
FLOAT32_MIN_MARGIN = 1e-3
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
    """Ids without speculation, and per prompt how many of them come before the first near-tie (top-1 minus
    top-2 logprob at most ``FLOAT32_MIN_MARGIN``, where float noise may flip the choice)."""
    llm = LLM(path, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    ids, clear = [], []
    for output in outputs:
        margins = [sorted((entry.logprob for entry in position.values()), reverse=True)
                   for position in output.outputs[0].logprobs]
        near_ties = [step for step, top in enumerate(margins) if top[0] - top[1] <= FLOAT32_MIN_MARGIN]
        ids.append(output.outputs[0].token_ids)
        clear.append(near_ties[0] if near_ties else len(margins))
    assert sum(clear) >= 0.8 * NUM_PROMPTS * NUM_NEW_TOKENS, "checkpoint not peaked enough for the margin rule"
    return ids, clear


def assert_equal_before_near_ties(got, expected, clear):
    for prompt_index, (mine, theirs, n) in enumerate(zip(got, expected, clear)):
        assert mine[:n] == theirs[:n], f"prompt {prompt_index}: differs before its first near-tie (step {n})"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_ids_equal_those_without_speculation(tiny_checkpoint, prompts, arch):
    path = tiny_checkpoint(arch)
    expected, clear = greedy_reference(path, prompts)
    llm = LLM(path, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    batched = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in prompts]
    counts = llm.llm_engine.engine_core.engine_core.scheduler.spec_decode_counts
    llm.shutdown()
    assert_equal_before_near_ties(batched, expected, clear)
    assert_equal_before_near_ties(alone, expected, clear)
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
