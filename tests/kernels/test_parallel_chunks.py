"""The C++ kernels split their work into chunks that threads claim as they go (csrc/parallel.h): every
output must be written exactly once and come out the same bits whatever the thread count and whichever
thread takes which chunk (more threads than cores included, where chunks interleave the most)."""

import pytest
import torch

from quire.kernels import cpu_extension

CPU_KERNELS = cpu_extension.load()
pytestmark = pytest.mark.skipif(CPU_KERNELS is None, reason="Quire's C++ CPU kernels could not be built here")

THREAD_COUNTS = (1, 2, 3, 7)


def on_threads(compute):
    """``compute()`` on each thread count; outputs are filled with garbage first (torch.empty) so an
    index no chunk wrote shows up as a difference."""
    before = torch.get_num_threads()
    results = []
    try:
        for threads in THREAD_COUNTS:
            torch.set_num_threads(threads)
            results.append(compute())
    finally:
        torch.set_num_threads(before)
    return results


def assert_same_bits(results):
    first = results[0]
    for threads, other in zip(THREAD_COUNTS[1:], results[1:]):
        for a, b in zip(first, other):
            assert torch.equal(a, b), f"{threads} threads differ from one"


@pytest.mark.parametrize("rows,out_features,in_features",
                         [(1, 1000, 96), (37, 601, 64), (130, 97, 40), (129, 1, 33), (1030, 97, 40)])
def test_linear_is_the_same_on_any_thread_count(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    assert_same_bits(on_threads(lambda: (CPU_KERNELS.linear_bf16(x, weight, bias),
                                         CPU_KERNELS.linear_bf16(x.float(), weight, None))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_kernels_are_the_same_on_any_thread_count(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(700, 128, generator=g).to(dtype)
    residual = torch.randn(700, 128, generator=g).to(dtype)
    weight = torch.randn(128, generator=g).to(dtype)
    heads = torch.randn(700, 4, 32, generator=g).to(dtype)
    cos, sin = torch.randn(700, 16, generator=g).to(dtype), torch.randn(700, 16, generator=g).to(dtype)
    gate_up = torch.randn(3, 2 * 4096, generator=g).to(dtype)  # few rows: each row is split too
    logits = torch.randn(300, 1000, generator=g).to(dtype)
    assert_same_bits(on_threads(lambda: (
        *CPU_KERNELS.rms_norm(x, residual, weight, 1e-6), CPU_KERNELS.rotate(heads, cos, sin),
        CPU_KERNELS.silu_and_mul(gate_up), CPU_KERNELS.silu_and_mul(torch.cat([gate_up] * 50)),
        CPU_KERNELS.argmax_rows(logits))))


@pytest.mark.parametrize("num_requests", [1, 3, 45])  # head splits at small batches, whole requests at large
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_is_the_same_on_any_thread_count(num_requests, dtype):
    g = torch.Generator().manual_seed(num_requests)
    block_size, num_kv_heads, head_dim, blocks_per_request = 8, 4, 32, 12
    seq_lens = torch.randint(1, block_size * blocks_per_request, (num_requests,), generator=g)
    num_blocks = num_requests * blocks_per_request + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1)[:num_requests * blocks_per_request]
    tables = tables.view(num_requests, blocks_per_request)
    query = torch.randn(num_requests, 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    assert_same_bits(on_threads(lambda: (
        CPU_KERNELS.paged_decode(query, cache[0], cache[1], tables, seq_lens, 0.2),)))
