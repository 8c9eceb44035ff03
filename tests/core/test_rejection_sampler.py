"""The rejection sampler: greedy verification, output distributions equal to the target's (and a broken
replacement step caught), seeded rows that ignore the batch, and target logprobs of the output tokens."""

import pytest
import torch

from quire.core.worker import rejection_sampler
from quire.core.worker.rejection_sampler import RejectionSampler
from quire.core.worker.sampler import Sampler, SamplingMetadata
from quire.core.worker.sampling_metadata import step_seed
from tests.stats import chi_square_p_value

TARGET_PROBS = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
DRAFT_PROBS = torch.tensor([0.02, 0.05, 0.08, 0.10, 0.10, 0.15, 0.20, 0.30])
NUM_SAMPLES = 5000


def metadata(temperatures, **fields):
    return SamplingMetadata(temperature=torch.tensor(temperatures, dtype=torch.float32), **fields)


def generator(seed):
    return torch.Generator().manual_seed(seed)


def greedy_logits(argmaxes, vocab_size=6):
    """Target logits whose argmax at each position is the given token."""
    logits = torch.rand(len(argmaxes), vocab_size, generator=generator(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def rows(output):
    """Each row's output tokens, padding dropped."""
    return [[t for t in row if t >= 0] for row in output.token_ids.tolist()]


def test_chi_square_p_value_matches_the_table():
    # tables give 18.475 as the critical value for p = 0.01 at 7 degrees of freedom
    statistic = torch.tensor(18.475, dtype=torch.float64)
    assert torch.special.gammaincc(torch.tensor(3.5, dtype=torch.float64), statistic / 2).item() == pytest.approx(
        0.01, abs=1e-5)
    assert chi_square_p_value(torch.full((8,), 100.0), torch.full((8,), 100.0)) == pytest.approx(1.0)


def test_greedy_rows_stop_at_the_first_mismatch_and_add_a_bonus_when_all_match():
    # row 0 matches 2 of 3, row 1 matches both (bonus 0), row 2 has no drafts, row 3 misses its only draft
    argmaxes = [2, 4, 5, 3] + [1, 1, 0] + [3] + [0, 4]
    drafts = torch.tensor([2, 4, 1] + [1, 1] + [] + [2], dtype=torch.int64)
    sampler = RejectionSampler(generator(0))
    output = sampler(greedy_logits(argmaxes), drafts, [3, 2, 0, 1], metadata([0.0] * 4))
    assert output.token_ids.tolist() == [[2, 4, 5, -1], [1, 1, 0, -1], [3, -1, -1, -1], [0, -1, -1, -1]]
    assert output.num_accepted.tolist() == [2, 2, 0, 0]


def test_greedy_rows_ignore_random_rows_and_draft_probabilities_beside_them():
    argmaxes = [2, 4, 5, 3] + [1, 2] + [3, 0]
    logits = greedy_logits(argmaxes)
    drafts = torch.tensor([2, 4, 1, 0, 3], dtype=torch.int64)
    draft_probs = torch.full((5, 6), 1 / 6)
    sampler = RejectionSampler(generator(0))
    output = sampler(logits, drafts, [3, 1, 1], metadata([0.0, 1.0, 0.0]), draft_probs=draft_probs)
    assert rows(output)[0] == [2, 4, 5] and rows(output)[2] == [3, 0]
    assert output.num_accepted[[0, 2]].tolist() == [2, 1]


def test_rows_without_drafts_sample_as_the_normal_sampler():
    logits = torch.randn(6, 40, generator=generator(1)) * 2
    seeded_rows = {1: step_seed(42, 5), 4: step_seed(7, 0)}
    fields = dict(top_k=torch.tensor([40, 5, 40, 40, 3, 40]), top_p=torch.tensor([1.0, 1.0, 0.8, 1.0, 0.9, 1.0]),
                  min_p=torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0]), seeded_rows=seeded_rows)
    temperatures = [1.0, 0.7, 1.3, 0.0, 1.0, 0.9]
    expected = Sampler(generator(3))(logits.clone(), metadata(temperatures, **fields)).token_ids
    no_drafts = torch.zeros(0, dtype=torch.int64)
    output = RejectionSampler(generator(3))(logits, no_drafts, [0] * 6, metadata(temperatures, **fields),
                                            seeds={1: (42, 5), 4: (7, 0)})
    assert output.token_ids[:, 0].tolist() == expected.tolist()
    assert output.num_accepted.tolist() == [0] * 6


def test_top_k_one_makes_a_random_row_verify_greedily():
    argmaxes = [2, 4, 5, 3]
    drafts = torch.tensor([2, 4, 1], dtype=torch.int64)
    top_1 = metadata([1.0], top_k=torch.tensor([1]))
    output = RejectionSampler(generator(0))(greedy_logits(argmaxes), drafts, [3], top_1,
                                            draft_probs=torch.full((3, 6), 1 / 6))
    assert rows(output) == [[2, 4, 5]]


def speculative_first_tokens(draft_token_ids, draft_probs):
    """The first output token of NUM_SAMPLES rows with one draft each, all with target TARGET_PROBS."""
    logits = TARGET_PROBS.log().repeat(2 * NUM_SAMPLES, 1)
    sampler = RejectionSampler(generator(11))
    output = sampler(logits, draft_token_ids, [1] * NUM_SAMPLES, metadata([1.0] * NUM_SAMPLES), draft_probs=draft_probs)
    return torch.bincount(output.token_ids[:, 0], minlength=len(TARGET_PROBS)).float()


def direct_counts():
    logits = TARGET_PROBS.log().repeat(NUM_SAMPLES, 1)
    tokens = Sampler(generator(12))(logits, metadata([1.0] * NUM_SAMPLES)).token_ids
    return torch.bincount(tokens, minlength=len(TARGET_PROBS)).float()


def drafts_from_draft_probs():
    return torch.multinomial(DRAFT_PROBS, NUM_SAMPLES, replacement=True, generator=generator(10))


def test_outputs_follow_the_target_distribution_with_draft_probabilities():
    counts = speculative_first_tokens(drafts_from_draft_probs(), DRAFT_PROBS.repeat(NUM_SAMPLES, 1))
    assert chi_square_p_value(counts, direct_counts()) > 0.01


def test_a_replacement_drawn_from_the_target_is_caught(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "_residual_probs", lambda target_probs, draft_probs: target_probs)
    counts = speculative_first_tokens(drafts_from_draft_probs(), DRAFT_PROBS.repeat(NUM_SAMPLES, 1))
    assert chi_square_p_value(counts, direct_counts()) < 0.01


def test_outputs_follow_the_target_distribution_without_draft_probabilities():
    # an n-gram proposer: the same guess every time, q one-hot on it
    counts = speculative_first_tokens(torch.full((NUM_SAMPLES,), 1, dtype=torch.int64), None)
    assert chi_square_p_value(counts, direct_counts()) > 0.01


def test_a_replacement_that_may_repeat_the_rejected_guess_is_caught(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "_residual_probs", lambda target_probs, draft_probs: target_probs)
    counts = speculative_first_tokens(torch.full((NUM_SAMPLES,), 1, dtype=torch.int64), None)
    assert chi_square_p_value(counts, direct_counts()) < 0.01


def random_batch(num_draft_tokens, seed, vocab_size=50):
    """Target logits, draft tokens drawn from their draft probabilities, and those probabilities."""
    gen = generator(seed)
    num_drafts = sum(num_draft_tokens)
    logits = torch.randn(num_drafts + len(num_draft_tokens), vocab_size, generator=gen)
    draft_probs = (torch.randn(num_drafts, vocab_size, generator=gen) + logits[:num_drafts]).softmax(-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen)[:, 0] if num_drafts else torch.zeros(0, dtype=torch.int64)
    return logits, drafts, draft_probs


def row_slices(num_draft_tokens, row):
    target_start = sum(k + 1 for k in num_draft_tokens[:row])
    draft_start = sum(num_draft_tokens[:row])
    k = num_draft_tokens[row]
    return slice(target_start, target_start + k + 1), slice(draft_start, draft_start + k)


@pytest.mark.parametrize("has_draft_probs", [True, False])
def test_seeded_rows_do_not_depend_on_the_batch_around_them(has_draft_probs):
    logits, drafts, draft_probs = random_batch([3], seed=5)

    def seeded_row(seed, neighbours_seed, num_draft_tokens=(1, 0, 3, 2), row=2):
        num_draft_tokens = list(num_draft_tokens)
        num_draft_tokens.insert(row, 3)
        batch_logits, batch_drafts, batch_probs = random_batch(num_draft_tokens, seed=neighbours_seed)
        targets, draft_slice = row_slices(num_draft_tokens, row)
        batch_logits[targets], batch_drafts[draft_slice], batch_probs[draft_slice] = logits, drafts, draft_probs
        temperatures = [0.8] * len(num_draft_tokens)
        output = RejectionSampler(generator(neighbours_seed))(
            batch_logits, batch_drafts, num_draft_tokens, metadata(temperatures, seeded_rows={row: 0}),
            draft_probs=batch_probs if has_draft_probs else None, seeds={row: (seed, 9)})
        return rows(output)[row]

    alone = seeded_row(42, 0, num_draft_tokens=(), row=0)
    assert seeded_row(42, 1) == alone
    assert seeded_row(42, 2, num_draft_tokens=(2, 2), row=0) == alone
    assert len({tuple(seeded_row(seed, 0)) for seed in range(8)}) > 1


def test_output_logprobs_are_the_raw_target_logprobs():
    num_draft_tokens = [3, 0, 2, 4]
    logits, drafts, draft_probs = random_batch(num_draft_tokens, seed=8)
    sampler = RejectionSampler(generator(0))
    assert sampler(logits, drafts, num_draft_tokens, metadata([0.7, 1.2, 0.0, 0.5]),
                   draft_probs=draft_probs).logprobs is None  # only when asked for
    output = sampler(logits, drafts, num_draft_tokens, metadata([0.7, 1.2, 0.0, 0.5]), draft_probs=draft_probs,
                     output_logprobs=True)
    raw_logprobs = logits.log_softmax(-1)
    for row, tokens in enumerate(rows(output)):
        targets, _ = row_slices(num_draft_tokens, row)
        expected = raw_logprobs[targets][torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(output.logprobs[row, :len(tokens)], expected)
        assert output.logprobs[row, len(tokens):].isnan().all()


def test_seeded_rows_must_say_where_their_positions_start():
    logits, drafts, _ = random_batch([2], seed=0)
    with pytest.raises(ValueError, match="seeds"):
        RejectionSampler(generator(0))(logits, drafts, [2], metadata([1.0], seeded_rows={0: 1}))
    with pytest.raises(ValueError, match="target_logits"):
        RejectionSampler(generator(0))(logits[:2], drafts, [2], metadata([1.0]))
