"""Speculative decoding with n-gram proposals and with a draft model, end to end: greedy ids equal those
without speculation on 20 prompts of the tiny checkpoints in float32 (margin rule: equal up to a step whose
reference margin is a near-tie, 90% of the steps compared), one at a time and batched; proposals are
accepted and the counts add up; seeded random sampling stays reproducible."""

import pytest

from quire.core import SamplingParams
from quire.offline import LLM
from tests.gguf.greedy import assert_greedy_agrees

NUM_PROMPTS = 20
NUM_NEW_TOKENS = 24
# disable_by_batch_size None: the batch of 20 speculates too
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
         "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    """Half repeat a passage (so that its continuation can be looked up), half do not."""
    result = []
    for i in range(NUM_PROMPTS):
        passage = corpus_token_ids[i * 311:i * 311 + 8 + i]
        result.append(passage * 3 if i % 2 == 0 else passage)
    return result


_REFERENCES = {}


def greedy_reference(path, prompts):
    """Per prompt: ids without speculation, and the top-1 minus top-2 logprob at each step (for the margin
    rule of ``tests.gguf.greedy``); computed once per checkpoint."""
    if path not in _REFERENCES:
        _REFERENCES[path] = _greedy_reference(path, prompts)
    return _REFERENCES[path]


def _greedy_reference(path, prompts):
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


def speculative_greedy(path, prompts, speculative_config):
    """Greedy ids of the prompts batched, then one at a time, and the engine's speculation counts; then the
    drafts and proposed tokens of 4 more requests of 21 tokens. No back-off: every step verifies proposals."""
    llm = LLM(path, dtype="float32", max_model_len=256, speculative_config=speculative_config)
    core = llm.llm_engine.engine_core.engine_core
    core.backoff.min_accepted_per_step = 0
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    batched = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in prompts]
    counts = core.scheduler.spec_decode_counts
    before = counts.num_drafts, counts.num_draft_tokens
    # 1 + 5m tokens: when every proposal is accepted, max_tokens never cuts a proposal short
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=21, ignore_eos=True), use_tqdm=False)
    full_room = counts.num_drafts - before[0], counts.num_draft_tokens - before[1]
    core.check_idle_invariants()
    assert not core.proposer.states, "the draft model's per-request state was not released"
    assert len(core.proposer.free_blocks) == core.proposer.num_blocks - 1, "draft KV blocks leaked"
    llm.shutdown()
    return batched, alone, counts, full_room


@pytest.mark.parametrize(("target", "draft"), [("llama", "llama"), ("llama", "qwen2"), ("qwen3", "llama")])
def test_greedy_ids_with_a_draft_model_equal_those_without(tiny_checkpoint, prompts, target, draft):
    """The target as its own draft (every proposal accepted: the bonus-token path) and another model of the
    same tokenizer (mostly rejected: the rollback path)."""
    path = tiny_checkpoint(target)
    reference = greedy_reference(path, prompts)
    config = {"method": "draft_model", "model": tiny_checkpoint(draft), "num_speculative_tokens": 4,
              "disable_by_batch_size": None}
    batched, alone, counts, full_room = speculative_greedy(path, prompts, config)
    assert_greedy_agrees(batched, reference, prompts, NUM_NEW_TOKENS)
    assert_greedy_agrees(alone, reference, prompts, NUM_NEW_TOKENS)
    assert counts.num_drafts > 0
    assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
    if target == draft:
        assert counts.num_accepted_tokens == counts.num_draft_tokens
        # no back-off and room for every proposal: each verification step proposed k tokens
        num_drafts, num_draft_tokens = full_room
        assert num_drafts > 0 and num_draft_tokens == 4 * num_drafts
    else:
        assert counts.num_accepted_tokens < counts.num_draft_tokens


def test_requests_whose_proposals_fail_back_off(tiny_checkpoint, prompts):
    """A draft model that mostly disagrees with the target: requests pause speculating, so far fewer steps
    verify proposals than decode; the greedy ids stay those without speculation."""
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_model_len=256, speculative_config={
        "method": "draft_model", "model": tiny_checkpoint("qwen2"), "num_speculative_tokens": 4})
    core = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    steps_before = core.num_steps
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in prompts]
    num_steps = core.num_steps - steps_before
    counts = core.scheduler.spec_decode_counts
    llm.shutdown()
    assert core.backoff.num_pauses >= NUM_PROMPTS // 2
    assert counts.num_accepted_tokens < 0.5 * counts.num_drafts  # the back-off's mark is 0.5 per step
    assert counts.num_drafts < 0.5 * num_steps
    assert_greedy_agrees(alone, greedy_reference(path, prompts), prompts, NUM_NEW_TOKENS)


def test_logprobs_are_the_target_models(tiny_checkpoint, prompts):
    """Requests with logprobs speculate too; each output token's logprobs (the token's, its rank and the top
    2) are the target model's at that position, as without speculation."""
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=2)
    speculative = [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]
    counts = llm.llm_engine.engine_core.engine_core.scheduler.spec_decode_counts
    llm.shutdown()
    plain_llm = LLM(path, dtype="float32", max_model_len=256)
    plain = [output.outputs[0] for output in plain_llm.generate(prompts, params, use_tqdm=False)]
    plain_llm.shutdown()
    assert counts.num_accepted_tokens > 0
    num_compared = 0
    for with_spec, without in zip(speculative, plain):
        assert len(with_spec.logprobs) == len(with_spec.token_ids)
        for token, position, reference in zip(with_spec.token_ids, with_spec.logprobs, without.logprobs):
            if token not in reference:
                break  # the outputs part at a near-tie (the margin rule): later positions differ in context
            assert position[token].rank == reference[token].rank
            assert position[token].logprob == pytest.approx(reference[token].logprob, abs=1e-4)
            assert sorted(position) == sorted(reference)  # the same top tokens
            num_compared += 1
    assert num_compared >= 0.9 * NUM_PROMPTS * NUM_NEW_TOKENS


def test_seeded_random_sampling_is_reproducible(tiny_checkpoint, prompts):
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, seed=7)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:6], params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:6]]
    llm.shutdown()
    assert first == alone
    assert all(len(ids) == NUM_NEW_TOKENS for ids in first)
