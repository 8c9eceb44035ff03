import math

import pytest
import torch

from quire.kernels import cpu_extension
from quire.kernels.attention import paged_attention
from quire.kernels.kv_cache import write_kv_cache

CPU_KERNELS = cpu_extension.load()
DECODE_PATHS = [pytest.param(None, id="torch"), pytest.param(CPU_KERNELS, id="cpu-kernel")]


def dense_causal_attention(q, k, v, scale, sliding_window=None):
    """Reference: q [Lq, Hq, D] at the last Lq positions of k/v [Lk, Hk, D]; with a ``sliding_window`` W, the
    query at position p sees keys at p - W + 1 .. p only."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    offset = k.shape[0] - q.shape[0]
    key_positions, query_positions = torch.arange(k.shape[0])[None, :], torch.arange(q.shape[0])[:, None] + offset
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def write_requests(seqs, num_blocks, block_size, num_kv_heads, head_dim, dtype, generator):
    """Scatter each request's keys/values over random, non-contiguous blocks of a fresh cache."""
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    free = torch.randperm(num_blocks - 1, generator=generator) + 1
    tables, keys, values, used = [], [], [], 0
    for seq_len in seqs:
        n = math.ceil(seq_len / block_size)
        blocks = free[used:used + n]
        used += n
        tables.append(blocks)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        positions = torch.arange(seq_len)
        slots = blocks[positions // block_size] * block_size + positions % block_size
        write_kv_cache(k, v, kv[0], kv[1], slots)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return kv, table, keys, values


def test_write_kv_cache_places_tokens_by_slot():
    kv = torch.zeros(2, 4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    write_kv_cache(key, -key, kv[0], kv[1], torch.tensor([7, 2, 3]))
    assert torch.equal(kv[0, 3, 1, 0], key[0, 0])  # slot 7 = block 3, offset 1
    assert torch.equal(kv[0, 1, 0, 0], key[1, 0])
    assert torch.equal(kv[1, 1, 1, 0], -key[2, 0])
    assert kv[0, 0].abs().sum() == 0


def test_the_cpu_kernels_build_here():
    assert CPU_KERNELS is not None, "the C++ CPU kernels should compile on this machine"


@pytest.mark.parametrize("kernel", DECODE_PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_attention_mixed_batch_matches_dense(dtype, tol, num_heads, num_kv_heads, kernel):
    """Decodes, a whole prompt, and prompt chunks over a cached prefix, in one flat batch."""
    g = torch.Generator().manual_seed(0)
    head_dim, block_size = 16, 4
    seq_lens = [1, 9, 23, 40, 17, 5]
    query_lens = [1, 1, 23, 7, 1, 3]  # 23: whole prompt; 7 and 3: chunks after a cached prefix
    kv, table, keys, values = write_requests(seq_lens, 64, block_size, num_kv_heads, head_dim, dtype, g)
    queries = [torch.randn(n, num_heads, head_dim, generator=g).to(dtype) for n in query_lens]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    scale = head_dim**-0.5
    out = paged_attention(torch.cat(queries), kv[0], kv[1], table, seq_lens, starts, scale, kernel)
    for i, q in enumerate(queries):
        expected = dense_causal_attention(q, keys[i], values[i], scale)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", DECODE_PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_many_decodes_of_different_lengths(kernel, dtype, tol):
    g = torch.Generator().manual_seed(5)
    seq_lens = [int(n) for n in torch.randint(1, 90, (45,), generator=g)]
    kv, table, keys, values = write_requests(seq_lens, 700, 8, 2, 16, dtype, g)
    query = torch.randn(len(seq_lens), 4, 16, generator=g).to(dtype)
    out = paged_attention(query, kv[0], kv[1], table, seq_lens, list(range(len(seq_lens) + 1)), 0.25, kernel)
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(query[i:i + 1], keys[i], values[i], 0.25)
        torch.testing.assert_close(out[i:i + 1].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_requests", [3, 40])  # a work item per KV head, and per request (all its heads)
def test_bf16_decodes_with_wide_heads_match_dense(num_requests):
    """bfloat16 heads of 64 (the AVX-512 BF16 path where the CPU has it) shared by three query heads each."""
    g = torch.Generator().manual_seed(13)
    seq_lens = [int(n) for n in torch.randint(1, 120, (num_requests,), generator=g)]
    kv, table, keys, values = write_requests(seq_lens, 400, 16, 3, 64, torch.bfloat16, g)
    query = torch.randn(num_requests, 9, 64, generator=g).to(torch.bfloat16)
    out = paged_attention(query, kv[0], kv[1], table, seq_lens, list(range(num_requests + 1)), 0.125, CPU_KERNELS)
    for i in range(num_requests):
        expected = dense_causal_attention(query[i:i + 1], keys[i], values[i], 0.125)
        torch.testing.assert_close(out[i:i + 1].float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 40), (10, 2, 128), (5, 5, 24)])
def test_decodes_of_every_head_group_and_width_match_dense(dtype, tol, num_heads, num_kv_heads, head_dim):
    """Groups of 4 and 5 query heads (the AVX2 path's tiles of at most 3 heads, then the rest) and widths that
    are not a multiple of 32 (its 8-wide tail) or are wide (128)."""
    g = torch.Generator().manual_seed(head_dim)
    seq_lens = [1, 2, 3, 4, 5, 31, 67]
    kv, table, keys, values = write_requests(seq_lens, 64, 8, num_kv_heads, head_dim, dtype, g)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = paged_attention(query, kv[0], kv[1], table, seq_lens, list(range(len(seq_lens) + 1)), scale, CPU_KERNELS)
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(query[i:i + 1], keys[i], values[i], scale)
        torch.testing.assert_close(out[i:i + 1].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", DECODE_PATHS)
@pytest.mark.parametrize("num_requests", [5, 40])  # one decode group, and several (sorted by length)
def test_pure_decode_batches_keep_token_order(num_requests, kernel):
    g = torch.Generator().manual_seed(9)
    seq_lens = [int(n) for n in torch.randint(1, 60, (num_requests,), generator=g)]
    kv, table, keys, values = write_requests(seq_lens, 600, 4, 1, 8, torch.float32, g)
    query = torch.randn(num_requests, 2, 8, generator=g)
    out = paged_attention(query, kv[0], kv[1], table, seq_lens, list(range(num_requests + 1)), 0.3, kernel)
    for i in range(num_requests):
        torch.testing.assert_close(out[i:i + 1], dense_causal_attention(query[i:i + 1], keys[i], values[i], 0.3),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", DECODE_PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_short_queries_match_dense(kernel, dtype, tol):
    """A step of short queries only (speculative verification: 1 + k tokens per request), which the C++ path
    runs as one decode per query, and the same beside a long prompt chunk."""
    g = torch.Generator().manual_seed(3)
    for seq_lens, query_lens in (([9, 23, 40, 5], [5, 1, 3, 5]), ([9, 30, 40], [5, 30, 16])):
        kv, table, keys, values = write_requests(seq_lens, 64, 4, 2, 16, dtype, g)
        queries = [torch.randn(n, 4, 16, generator=g).to(dtype) for n in query_lens]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        out = paged_attention(torch.cat(queries), kv[0], kv[1], table, seq_lens, starts, 0.25, kernel)
        for i, q in enumerate(queries):
            expected = dense_causal_attention(q, keys[i], values[i], 0.25)
            torch.testing.assert_close(out[starts[i]:starts[i + 1]].float(), expected, rtol=tol, atol=tol)


def poison_blocks_outside_windows(kv, table, seq_lens, query_lens, block_size, window):
    """Fill with NaN every block wholly before the window of a request's first query (a block the KV-cache
    manager may have released to another request): reading one, even masked out, makes the output NaN."""
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        num_outside = max(0, seq_len - query_len - window + 1) // block_size
        kv[:, table[i, :num_outside]] = float("nan")


def flat_batch(query_lens, num_heads, head_dim, dtype, g):
    queries = [torch.randn(n, num_heads, head_dim, generator=g).to(dtype) for n in query_lens]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return queries, starts


@pytest.mark.parametrize("kernel", DECODE_PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [1, 5, 8, 16, 64])
def test_sliding_window_mixed_batch_matches_dense(kernel, dtype, tol, window):
    """Decodes, a whole prompt and chunks over a cached prefix, each query seeing only its last ``window``
    keys, without reading the blocks before the window (poisoned here); 64 is wider than every request."""
    g = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    seq_lens = [1, 9, 23, 40, 17, 5, 60]
    query_lens = [1, 1, 23, 7, 1, 3, 20]  # 23: a whole prompt; 7, 3 and 20: chunks after a cached prefix
    kv, table, keys, values = write_requests(seq_lens, 80, block_size, num_kv_heads, head_dim, dtype, g)
    poison_blocks_outside_windows(kv, table, seq_lens, query_lens, block_size, window)
    queries, starts = flat_batch(query_lens, num_heads, head_dim, dtype, g)
    out = paged_attention(torch.cat(queries), kv[0], kv[1], table, seq_lens, starts, 0.25, kernel,
                          sliding_window=window)
    for i, q in enumerate(queries):
        expected = dense_causal_attention(q, keys[i], values[i], 0.25, sliding_window=window)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_requests", [5, 40])  # one decode group, and several (sorted by length)
@pytest.mark.parametrize("window", [3, 16, 33])
def test_sliding_window_decodes_match_dense(num_requests, window):
    """Pure decode steps: each request reads its window's blocks only, padded to the widest span."""
    g = torch.Generator().manual_seed(13)
    seq_lens = [int(n) for n in torch.randint(1, 120, (num_requests,), generator=g)]
    kv, table, keys, values = write_requests(seq_lens, 1500, 8, 2, 16, torch.float32, g)
    poison_blocks_outside_windows(kv, table, seq_lens, [1] * num_requests, 8, window)
    query = torch.randn(num_requests, 4, 16, generator=g)
    out = paged_attention(query, kv[0], kv[1], table, seq_lens, list(range(num_requests + 1)), 0.25, CPU_KERNELS,
                          sliding_window=window)
    for i in range(num_requests):
        expected = dense_causal_attention(query[i:i + 1], keys[i], values[i], 0.25, sliding_window=window)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_prefill_after_a_cached_prefix_reads_from_the_window_on():
    """A chunk of 10 queries after 50 cached tokens, window 12, blocks of 4: the first query (position 50) sees
    39..50, so blocks 0-8 (positions 0..35) are never read, and block 9 (36..39) is read but masked in part."""
    g = torch.Generator().manual_seed(17)
    kv, table, keys, values = write_requests([60], 20, 4, 1, 8, torch.float32, g)
    kv[:, table[0, :9]] = float("nan")
    kv[:, table[0, 9], :3] = 1e4  # positions 36..38: read, but outside every window
    query = torch.randn(10, 2, 8, generator=g)
    out = paged_attention(query, kv[0], kv[1], table, [60], [0, 10], 0.3, sliding_window=12)
    expected = dense_causal_attention(query, keys[0], values[0], 0.3, sliding_window=12)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompts_of_one_length_run_as_one_batch_with_the_bits_of_each_alone(dtype):
    """Without a prefill kernel, whole prompts are batched by length over the step's own key/value rows: each
    prompt's output is bit for bit what it gets alone from the gathered cache, and mixed steps (a cached
    prefix, a decode) keep their other paths."""
    from quire.kernels.attention import plan_paged_attention, run_paged_attention

    generator = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    seqs = [40, 7, 40, 40, 7, 100, 33]
    query_lens = [40, 7, 40, 40, 7, 1, 5]  # the last two: a decode and a chunk after a cached prefix
    kv, tables, keys, values = write_requests(seqs, 64, block_size, num_kv_heads, head_dim, dtype, generator)
    step_keys = torch.cat([k[-n:] for k, n in zip(keys, query_lens)])
    step_values = torch.cat([v[-n:] for v, n in zip(values, query_lens)])
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    plan = plan_paged_attention(tables, seqs, starts, block_size)
    assert sorted((b.count, b.length) for b in plan.prompt_batches) == [(2, 7), (3, 40)]
    batched = run_paged_attention(query, kv[0], kv[1], plan, 0.125, step_keys, step_values)
    alone = run_paged_attention(query, kv[0], kv[1], plan, 0.125)  # without the step's rows: prompt by prompt
    assert torch.equal(batched, alone)
    for i, (k, v) in enumerate(zip(keys, values)):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(batched[rows].float(), dense_causal_attention(query[rows], k, v, 0.125),
                                   **({"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}))
