"""The C++ CPU kernels treat infinities and NaN as their PyTorch references do.

They are built without -ffast-math for this: its -ffinite-math-only lets the compiler assume that no value is
infinite or NaN (and fold the comparisons and reductions that meet them), -fassociative-math lets it reorder
sums that the bfloat16 kernels promise to reproduce bit for bit.
"""

import pytest
import torch

from quire.kernels import cpu_extension
from quire.kernels.activation import silu_and_mul_reference
from quire.kernels.attention import paged_attention
from quire.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from quire.kernels.sampling import argmax_reference

CPU_KERNELS = cpu_extension.load()
pytestmark = pytest.mark.skipif(CPU_KERNELS is None, reason="the C++ CPU kernels do not build here")

INF, NAN = float("inf"), float("nan")
# as in test_norm_activation: bfloat16 results are PyTorch's to the bit, float32 ones to the last bits
TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=0, atol=0)}


def assert_same(got, expected, dtype):
    torch.testing.assert_close(got, expected, equal_nan=True, **TOLERANCES[dtype])


def nonfinite_rows(dtype, width=96):
    """Rows of a normal one, then one NaN, +inf, -inf, both infinities, and values whose squares overflow."""
    torch.manual_seed(6)
    rows = torch.randn(7, width)
    rows[1, 5] = NAN
    rows[2, 7] = INF
    rows[3, 0] = -INF
    rows[4, 1], rows[4, 2] = INF, -INF
    rows[5, :] = 3e38
    rows[6, :] = -3e38
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeps_infinities_and_nan(dtype):
    x = nonfinite_rows(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    assert_same(CPU_KERNELS.rms_norm(x, None, weight, 1e-6)[0], rms_norm_reference(x, weight, 1e-6), dtype)
    residual = nonfinite_rows(dtype).flip(0)  # +inf meets -inf, NaN meets a finite value
    out, summed = CPU_KERNELS.rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert_same(summed, expected_summed, dtype)
    assert_same(out, expected_out, dtype)
    assert out[0].isfinite().all() and out[1].isnan().all()  # the rows are independent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_keeps_infinities_and_nan(dtype):
    # NOTE: no gate far below -20: PyTorch's float32 silu underflows to -0.0 there (its exp overflows) where
    # the kernel, in double, keeps a denormal, and times an infinite ``up`` one is NaN, the other infinite
    specials = torch.tensor([-INF, INF, NAN, -20.0, 100.0, 0.0, -0.0, 1.5])
    gate, up = torch.cartesian_prod(specials, specials).unbind(-1)  # every pair
    x = torch.cat([gate, up]).view(1, -1).to(dtype)
    got, expected = CPU_KERNELS.silu_and_mul(x), silu_and_mul_reference(x)
    assert_same(got, expected, dtype)
    is_number = ~expected.isnan()  # a NaN's sign means nothing
    assert torch.equal(got.signbit()[is_number], expected.signbit()[is_number])  # -0.0 stays -0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_takes_the_first_infinity(dtype):
    logits = torch.randn(4, 300)
    logits[0, 10] = logits[0, 20] = INF
    logits[1, :] = -INF
    logits[1, 299] = INF
    logits[2, :] = 3e38
    logits[3, :] = -INF
    logits[3, 42] = -3e38
    logits = logits.to(dtype)
    expected = argmax_reference(logits)
    assert expected.tolist() == [10, 299, 0, 42]
    assert torch.equal(CPU_KERNELS.argmax_rows(logits), expected)


# head_dim 32: the AVX-512 bfloat16 path where the CPU has one; 16: the generic path
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_keeps_infinities_and_nan(dtype, tol, head_dim):
    g = torch.Generator().manual_seed(7)
    num_requests, seq_len, block_size, num_heads = 5, 21, 4, 2
    blocks_per_request = -(-seq_len // block_size)
    key = torch.randn(num_requests * blocks_per_request + 1, block_size, 1, head_dim, generator=g)
    value = torch.randn(key.shape, generator=g)
    table = torch.arange(1, key.shape[0]).view(num_requests, blocks_per_request)
    query = torch.randn(num_requests, num_heads, head_dim, generator=g).abs() + 0.1  # positive: scores follow keys
    key[table[1, 2], 1, 0, 3] = -INF  # request 1: one score is -inf, its token gets no weight
    key[table[2, 0], 3, 0, 0] = INF  # request 2: one score is +inf, every weight is NaN
    value[table[3, 4], 0, 0, 5] = NAN  # request 3: a NaN value poisons its output column
    key[table[4, 1], 2, 0, 1] = NAN  # request 4: a NaN score, every weight is NaN
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    seq_lens, starts = [seq_len] * num_requests, list(range(num_requests + 1))
    got = paged_attention(query, key, value, table, seq_lens, starts, 0.3, CPU_KERNELS)
    # NOTE: the reference is PyTorch's path in float32: its bfloat16 CPU attention turns a +inf score into
    # zero weights (an output of 0) where float32 gives NaN
    expected = paged_attention(query.float(), key.float(), value.float(), table, seq_lens, starts, 0.3, None)
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol, equal_nan=True)
    assert got[:2].isfinite().all() and got[2].isnan().all() and got[4].isnan().all()
    assert got[3, :, 5].isnan().all() and got[3, :, :5].isfinite().all()
