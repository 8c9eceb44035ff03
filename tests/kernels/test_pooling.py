"""Pooling ops against per-prompt loops; Matryoshka truncation and normalisation against sentence-transformers'
order (truncate, then normalise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quire.kernels.pooling import pool, truncate_and_normalize

LENGTHS = [1, 5, 3, 17, 2, 1, 64]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def flat_batch(lengths: list[int], hidden_size: int = 24, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    torch.manual_seed(0)
    hidden = torch.randn(sum(lengths), hidden_size, dtype=dtype, device=device)
    query_start_loc = [0]
    for length in lengths:
        query_start_loc.append(query_start_loc[-1] + length)
    return hidden, query_start_loc


def per_prompt_reference(hidden: torch.Tensor, query_start_loc: list[int], pooling_type: str) -> torch.Tensor:
    vectors = []
    for start, stop in zip(query_start_loc[:-1], query_start_loc[1:]):
        tokens = hidden[start:stop]
        vectors.append({"cls": tokens[0], "last": tokens[-1],
                        "mean": tokens.float().mean(dim=0).to(hidden.dtype)}[pooling_type])
    return torch.stack(vectors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooling_type", ["cls", "mean", "last"])
def test_pool_matches_a_per_prompt_loop(device, dtype, pooling_type):
    hidden, query_start_loc = flat_batch(LENGTHS, dtype=dtype, device=device)
    pooled = pool(hidden, query_start_loc, pooling_type)
    assert pooled.shape == (len(LENGTHS), hidden.shape[1]) and pooled.dtype == dtype
    expected = per_prompt_reference(hidden, query_start_loc, pooling_type)
    if pooling_type == "mean":
        torch.testing.assert_close(pooled, expected, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    else:
        assert torch.equal(pooled, expected)


def test_pool_takes_a_tensor_of_offsets_and_a_single_prompt():
    hidden, query_start_loc = flat_batch([9])
    offsets = torch.tensor(query_start_loc)
    torch.testing.assert_close(pool(hidden, offsets, "mean"), hidden.mean(dim=0, keepdim=True))
    assert torch.equal(pool(hidden, offsets, "last"), hidden[-1:])


def test_pool_refuses_an_unknown_type():
    hidden, query_start_loc = flat_batch([2])
    with pytest.raises(ValueError, match="pooling_type must be cls, mean or last; got 'max'"):
        pool(hidden, query_start_loc, "max")


@pytest.mark.parametrize("dimensions", [None, 8, 1, 24])
def test_truncate_then_normalize(dimensions):
    embeddings, _ = flat_batch([4], hidden_size=24)
    out = truncate_and_normalize(embeddings, dimensions, normalize=True)
    expected = F.normalize(embeddings[:, :dimensions], p=2, dim=-1, eps=1e-12)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(4), rtol=0, atol=1e-6)
    # a vector normalised before truncation (sentence-transformers' Normalize module) ends the same
    renormalised = truncate_and_normalize(F.normalize(embeddings, dim=-1), dimensions, normalize=True)
    torch.testing.assert_close(renormalised, expected, rtol=1e-6, atol=1e-7)


def test_truncate_without_normalizing_and_float32_output():
    embeddings = torch.randn(3, 16, dtype=torch.bfloat16)
    out = truncate_and_normalize(embeddings, 4, normalize=False)
    assert out.dtype == torch.float32 and torch.equal(out, embeddings[:, :4].float())
    assert truncate_and_normalize(torch.zeros(1, 4)).abs().sum() == 0  # eps keeps a zero vector finite


@pytest.mark.parametrize("dimensions", [0, 17])
def test_dimensions_out_of_range_are_refused(dimensions):
    with pytest.raises(ValueError, match="dimensions must be between 1 and 16"):
        truncate_and_normalize(torch.randn(2, 16), dimensions)
