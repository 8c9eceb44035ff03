"""The element-wise Triton kernels against their PyTorch references (odd widths, several rows)."""

from __future__ import annotations

import pytest
import torch

from quire.kernels.activation import silu_and_mul_reference
from quire.kernels.kv_cache import write_kv_cache_reference
from quire.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from quire.kernels.rotary import rope_cos_sin, rope_inv_freq, rotary_factors, rotate_reference
from quire.kernels.triton_ops import elementwise, interpreting
from tests.kernels.triton_ops.conftest import assert_within_ulps

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape, dtype, device, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)


def check(actual, expected, magnitude=None, roundings=1):
    """float32 closely; half precisions within one unit in the last place, except that the interpreter
    truncates each of the ``roundings`` casts to bfloat16 on the way, and each can cost a unit."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)
    else:
        truncating = interpreting() and actual.dtype == torch.bfloat16
        assert_within_ulps(actual, expected, magnitude, ulps=roundings + 1 if truncating else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [33, 256])
def test_rms_norm_with_and_without_residual(dtype, hidden, device):
    x = randn(7, hidden, dtype=dtype, device=device, seed=1)
    residual = randn(7, hidden, dtype=dtype, device=device, seed=2)
    weight = randn(hidden, dtype=dtype, device=device, seed=3, scale=0.5) + 1
    out, summed = elementwise.rms_norm(x, None, weight, 1e-6)
    assert summed is None
    check(out, rms_norm_reference(x.cpu(), weight.cpu(), 1e-6), roundings=2)
    out, summed = elementwise.rms_norm(x, residual, weight, 1e-6)
    _, expected_sum = fused_add_rms_norm_reference(x.cpu(), residual.cpu(), weight.cpu(), 1e-6)
    check(summed, expected_sum)
    # the normalisation of the kernel's own sum (a one-unit difference there would compound)
    check(out, rms_norm_reference(summed.cpu(), weight.cpu(), 1e-6), roundings=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 24])  # whole heads, and the leading dimensions partial rotary turns
def test_rotary_on_strided_query_and_key(dtype, rotary_dim, device):
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    # query and key are views of one fused projection, as in the model
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=4)
    query = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)[..., :rotary_dim]
    key = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)[..., :rotary_dim]
    table = rope_cos_sin(rope_inv_freq(rotary_dim, 10000.0), 64)
    positions = torch.tensor([0, 3, 17, 18, 63])
    cos, sin = rotary_factors(positions, table, dtype)
    out_q, out_k = elementwise.rotate(query, key, cos.to(device), sin.to(device))
    expected_q, expected_k = rotate_reference(query.cpu(), key.cpu(), cos, sin)
    for out, x, expected in ((out_q, query.cpu(), expected_q), (out_k, key.cpu(), expected_k)):
        half = rotary_dim // 2
        # the magnitude of the two rounded products that each output sums
        factors = (cos.float().abs() + sin.float().abs())[:, None]
        bound = (x[..., :half].float().abs() + x[..., half:].float().abs()) * factors
        check(out, expected, torch.cat([bound, bound], dim=-1), roundings=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [37, 1500])
def test_silu_and_mul(dtype, width, device):
    x = randn(3, 2 * width, dtype=dtype, device=device, seed=5, scale=3.0)
    out = elementwise.silu_and_mul(x)
    expected = silu_and_mul_reference(x.cpu())
    gate_silu = torch.nn.functional.silu(x[:, :width].cpu().float())
    check(out, expected, (gate_silu * x[:, width:].cpu().float()).abs(), roundings=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_by_slot_skipping_padding(dtype, device):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 24
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    key = randn(9, num_kv_heads, head_dim, dtype=dtype, device=device, seed=6)
    value = randn(9, num_kv_heads, head_dim, dtype=dtype, device=device, seed=7)
    slots = torch.tensor([4, 5, 6, 23, 9, -1, 0, 13, 12])
    elementwise.write_kv_cache(key, value, kv[0], kv[1], slots.to(device))
    expected = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    keep = slots >= 0
    write_kv_cache_reference(key.cpu()[keep], value.cpu()[keep], expected[0], expected[1], slots[keep])
    assert torch.equal(kv.cpu(), expected)  # a copy: bit for bit, and the padding row wrote nothing
