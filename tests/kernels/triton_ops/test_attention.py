"""The paged-attention Triton kernels against dense float32 attention over the same cached values.

Batches mix odd context lengths, partial blocks, several requests and grouped-query heads.
"""

from __future__ import annotations

import pytest
import torch

from quire.kernels.triton_ops import attention
from tests.kernels.test_attention import dense_causal_attention, poison_blocks_outside_windows, write_requests

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
HEADS = [pytest.param((4, 2, 32), id="gqa2-d32"), pytest.param((6, 2, 24), id="gqa3-d24")]


def cache_for(seq_lens, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    return write_requests(seq_lens, num_blocks, block_size, num_kv_heads, head_dim, dtype, generator)


def expected_rows(query, keys, values, query_lens, scale, sliding_window=None):
    rows, start = [], 0
    for k, v, n in zip(keys, values, query_lens):
        rows.append(dense_causal_attention(query[start:start + n].cpu(), k, v, scale, sliding_window))
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_paged_decode(dtype, heads, device):
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [1, 17, 33, 70]
    kv, tables, keys, values = cache_for(seq_lens, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim**-0.5
    out = attention.paged_decode(query.to(device), kv[0].to(device), kv[1].to(device), tables.to(device),
                                 torch.tensor(seq_lens).to(device), scale, max(seq_lens))
    expected = expected_rows(query, keys, values, [1] * len(seq_lens), scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_split_context_and_padding_rows(dtype, device):
    """Contexts split in partitions (some empty) and merged; a zero-length row (CUDA-graph padding)
    gives zeros."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    seq_lens = [5, 600, 70]
    kv, tables, keys, values = cache_for(seq_lens, num_kv_heads, head_dim, dtype)
    max_seq_len = 1500
    assert attention.decode_num_splits(len(seq_lens) + 1, num_kv_heads, max_seq_len) == 3
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=tables.dtype)])
    query = torch.randn(4, num_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = head_dim**-0.5
    out = attention.paged_decode(query.to(device), kv[0].to(device), kv[1].to(device), tables.to(device),
                                 torch.tensor(seq_lens + [0]).to(device), scale, max_seq_len)
    expected = expected_rows(query[:3], keys, values, [1, 1, 1], scale)
    torch.testing.assert_close(out[:3].float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)
    assert torch.equal(out[3].cpu(), torch.zeros_like(out[3].cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "batch"), [
    pytest.param((4, 2, 32), [(0, 5), (16, 7), (3, 1), (40, 33)], id="gqa2-prefix-and-decode"),
    pytest.param((6, 2, 24), [(0, 20), (9, 19)], id="gqa3-several-tiles"),
])
def test_paged_prefill_over_cached_prefix(dtype, heads, batch, device):
    """``batch`` holds (cached tokens, new queries) per request: plain prompts, chunks over a cached
    prefix, and a decode inside a mixed batch."""
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [context + n for context, n in batch]
    query_lens = [n for _, n in batch]
    kv, tables, keys, values = cache_for(seq_lens, num_kv_heads, head_dim, dtype, seed=3)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0)
    scale = head_dim**-0.5
    out = attention.paged_prefill(query.to(device), kv[0].to(device), kv[1].to(device), tables.to(device),
                                  torch.tensor(seq_lens).to(device), query_start_loc.to(device), scale,
                                  max(query_lens))
    expected = expected_rows(query, keys, values, query_lens, scale)
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [7, 40, 600])
def test_paged_decode_sliding_window(dtype, window, device):
    """Each request reads only its last ``window`` tokens (the blocks before them are poisoned), split in
    partitions as the window allows; 600 is wider than every context but one."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    seq_lens = [5, 640, 70, 41]
    kv, tables, keys, values = cache_for(seq_lens, num_kv_heads, head_dim, dtype)
    poison_blocks_outside_windows(kv, tables, seq_lens, [1] * len(seq_lens), 16, window)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = head_dim**-0.5
    out = attention.paged_decode(query.to(device), kv[0].to(device), kv[1].to(device), tables.to(device),
                                 torch.tensor(seq_lens).to(device), scale, 1500, sliding_window=window)
    expected = expected_rows(query, keys, values, [1] * len(seq_lens), scale, window)
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [5, 24, 100])
def test_paged_prefill_sliding_window(dtype, window, device):
    """Whole prompts of several tiles, chunks over a cached prefix and a decode, each query seeing its last
    ``window`` keys; the blocks before each request's first window are poisoned."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    batch = [(0, 90), (50, 40), (30, 1), (100, 7)]  # (cached tokens, new queries)
    seq_lens = [context + n for context, n in batch]
    query_lens = [n for _, n in batch]
    kv, tables, keys, values = cache_for(seq_lens, num_kv_heads, head_dim, dtype, seed=6)
    poison_blocks_outside_windows(kv, tables, seq_lens, query_lens, 16, window)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0)
    scale = head_dim**-0.5
    out = attention.paged_prefill(query.to(device), kv[0].to(device), kv[1].to(device), tables.to(device),
                                  torch.tensor(seq_lens).to(device), query_start_loc.to(device), scale,
                                  max(query_lens), sliding_window=window)
    expected = expected_rows(query, keys, values, query_lens, scale, window)
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)
