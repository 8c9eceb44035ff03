import pytest
import torch
import torch.nn.functional as F
from transformers.activations import GELUTanh
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from quire.kernels import cpu_extension
from quire.kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from quire.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    offset_rms_norm,
    offset_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from quire.kernels.sampling import argmax, argmax_reference

CPU_KERNELS = cpu_extension.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_matches_transformers_bitwise(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 64, dtype=dtype) * 3
    hf = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
    hf = hf.to(dtype)
    torch.testing.assert_close(rms_norm_reference(x, hf.weight, 1e-6), hf(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_reference_adds_then_normalises(dtype):
    torch.manual_seed(1)
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    weight = (torch.rand(32) + 0.5).to(dtype)
    out, new_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_reference(residual + x, weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_reference_matches_transformers_gemma3_bitwise(dtype):
    torch.manual_seed(5)
    x = torch.randn(7, 3, 64, dtype=dtype) * 3
    hf = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5)  # stored centred on 0: the norm scales by 1 + weight
    hf = hf.to(dtype)
    torch.testing.assert_close(offset_rms_norm_reference(x, hf.weight, 1e-6), hf(x), rtol=0, atol=0)


# The C++ kernels against the references: bfloat16 results are the same numbers (the kernels round
# wherever PyTorch stores bfloat16); float32 differs only in the last bits (summation order, fused
# multiply-adds).
TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=0, atol=0)}


# the kernels split rows over threads only from ~32K elements: 33 rows run on one thread, 1,000 in chunks
@pytest.mark.parametrize("rows", [33, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_norms_match_the_references(dtype, rows):
    torch.manual_seed(2)
    x, residual = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    for got, expected in ((rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)), (out, ref_out)):
        if dtype == torch.bfloat16 and rows > 100:
            # NOTE: the kernel sums the squares in another order than PyTorch's reduction; over many rows
            # a rare element lands on the other side of a bfloat16 rounding boundary (1 in 96,000 here):
            # one step of the normalised value, which the weight (up to 1.5) can make two of the output
            torch.testing.assert_close(got, expected, rtol=2**-6, atol=0)
            assert (got == expected).float().mean().item() > 0.9999
        else:
            torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    views = torch.randn(5, 6, 40).to(dtype)[:, 1:4]  # strided, like q/k cut from a fused projection
    torch.testing.assert_close(rms_norm(views, weight[:40], 1e-6), rms_norm_reference(views, weight[:40], 1e-6),
                               **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_silu_and_mul_matches_the_reference(dtype):
    torch.manual_seed(3)
    x = (torch.randn(33, 2 * 4864) * 3).to(dtype)
    # bfloat16: the same numbers, as a model's greedy tokens depend on them (one-ulp differences in the
    # activation were enough to flip a bfloat16 model's token against transformers)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_matches_the_reference(dtype):
    """The ``rms_norm`` kernel on float32 inputs, rounded once at the end: bfloat16 results are the same numbers."""
    torch.manual_seed(6)
    x = torch.randn(33, 4, 96).to(dtype)[:, 1:3]  # strided, like q/k heads cut from a fused projection
    weight = (0.3 * torch.randn(96)).to(dtype)
    torch.testing.assert_close(offset_rms_norm(x, weight, 1e-6), offset_rms_norm_reference(x, weight, 1e-6),
                               **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_transformers_gemma_mlp(dtype):
    torch.manual_seed(7)
    x = (torch.randn(9, 2 * 40) * 3).to(dtype)
    expected = GELUTanh()(x[..., :40]) * x[..., 40:]
    torch.testing.assert_close(gelu_tanh_and_mul_reference(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(gelu_tanh_and_mul(x), expected, rtol=0, atol=0)


def test_silu_and_mul_reference():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 10)
    torch.testing.assert_close(silu_and_mul_reference(x), F.silu(x[..., :5]) * x[..., 5:], rtol=0, atol=0)


@pytest.mark.parametrize("rows", [9, 200])  # one thread, and rows split over threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_takes_the_first_maximum_like_torch(dtype, rows):
    torch.manual_seed(4)
    logits = torch.randn(rows, 1000).to(dtype)
    logits[3, 17] = logits[3, 500] = 50.0  # a tie: the first index wins
    logits[5, :] = -1.0  # all equal
    logits[6, -1] = 80.0  # the last index
    logits[7, :] = float("-inf")
    logits[7, 123] = -1e30
    logits[8, :] = float("-inf")  # every token masked
    expected = argmax_reference(logits)
    assert expected[3] == 17 and expected[5] == 0 and expected[6] == 999 and expected[7] == 123
    assert CPU_KERNELS is not None
    assert torch.equal(CPU_KERNELS.argmax_rows(logits), expected)
    assert torch.equal(argmax(logits), expected)


def test_bfloat16_silu_and_mul_is_exact_for_every_gate_value():
    """Every bfloat16 gate (all 65,536 bit patterns): the kernel's float32 SiLU with its double-precision
    fallback near bfloat16 rounding midpoints gives the bits of a double-precision SiLU rounded to float32
    and then to bfloat16, as PyTorch's float32 SiLU (correctly rounded there) does."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.tensor([1.0, -3.0, 0.7109375], dtype=torch.bfloat16).repeat_interleave(gate.numel())
    gate = gate.repeat(3)
    x = torch.stack([gate, up]).view(1, -1)  # one row: [gates..., ups...]
    wide = gate.double()
    activated = (wide / (1.0 + torch.exp(-wide))).float().bfloat16().float()
    expected = (activated * up.float()).bfloat16()
    got = CPU_KERNELS.silu_and_mul(x).view(-1)
    same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
    assert same.all(), f"{(~same).sum().item()} gates differ, e.g. {gate[~same][:5].tolist()}"
