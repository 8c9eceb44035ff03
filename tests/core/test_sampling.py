"""Sampler pieces against their definitions, and seeded sampling that ignores the batch around it."""

import pytest
import torch

from quire.core.worker.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p
from quire.core.worker.sampling_metadata import step_seed
from quire.offline import LLM, SamplingParams


def reference_top_k(logits, k):
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def reference_top_p(logits, p):
    """Keep the most likely tokens, in order, until their probability first reaches p."""
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        probs = logits[row].softmax(-1)
        total = 0.0
        for index in probs.argsort(descending=True).tolist():
            out[row, index] = logits[row, index]
            total += probs[index].item()
            if total >= p[row]:
                break
    return out


def metadata(batch, temperature=1.0, **fields):
    return SamplingMetadata(temperature=torch.full((batch,), temperature), **fields)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    k = torch.tensor([1, 5, 50, 2**31 - 1])
    out = apply_top_k_top_p(logits, k, None)
    for row, kk in enumerate([1, 5, 50, 50]):
        torch.testing.assert_close(out[row], reference_top_k(logits[row:row + 1], kk)[0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2
    p = torch.tensor([0.1, 0.5, 0.9])
    torch.testing.assert_close(apply_top_k_top_p(logits, None, p), reference_top_p(logits, p))


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.35]))  # threshold 0.175
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(20000, 1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    counts = torch.bincount(sampler(logits.clone(), metadata(20000)).token_ids, minlength=3).float() / 20000
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)


def test_greedy_rows_and_blocked_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens = sampler(logits.clone(), metadata(2, temperature=0.0, banned_token_ids={1: [0]})).token_ids
    assert tokens.tolist() == [1, 1]


def test_seeded_rows_do_not_depend_on_their_neighbours():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 100, generator=gen)
    seed = step_seed(42, 7)
    alone = Sampler(torch.Generator().manual_seed(0))(logits[1:2].clone(), metadata(1, seeded_rows={0: seed}))
    batched = Sampler(torch.Generator().manual_seed(99))(logits.clone(), metadata(3, seeded_rows={1: seed}))
    alone, batched = alone.token_ids, batched.token_ids
    assert alone.item() == batched[1].item()


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 50:i * 50 + n] for i, n in enumerate((12, 40, 3, 90, 25, 7))]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_is_independent_of_batch_composition(llm, llama_checkpoint, prompts):
    seeded = SamplingParams(temperature=1.5, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    alone = tokens(llm.generate([prompts[0]], seeded, use_tqdm=False))[0]
    mixed = llm.generate(prompts, [seeded if i in (0, 3) else other for i in range(len(prompts))],
                         use_tqdm=False)
    assert tokens(mixed)[0] == alone
    chunked = LLM(llama_checkpoint, dtype="float32", max_model_len=512, max_num_batched_tokens=16)
    assert tokens(chunked.generate(prompts[::-1], seeded, use_tqdm=False))[-1] == alone
    # and the seed does matter
    reseeded = SamplingParams(temperature=1.5, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert tokens(llm.generate([prompts[0]], reseeded, use_tqdm=False))[0] != alone


def test_temperature_zero_and_top_k_one_equal_greedy(llm, prompts):
    greedy = tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False))
    top1 = tokens(llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=16),
                               use_tqdm=False))
    assert top1 == greedy
