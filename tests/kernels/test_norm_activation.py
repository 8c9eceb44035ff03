import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from quire.kernels.activation import silu_and_mul
from quire.kernels.norm import fused_add_rms_norm, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bitwise(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 64, dtype=dtype) * 3
    hf = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
    hf = hf.to(dtype)
    torch.testing.assert_close(rms_norm(x, hf.weight, 1e-6), hf(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_adds_then_normalises(dtype):
    torch.manual_seed(1)
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    weight = (torch.rand(32) + 0.5).to(dtype)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm(residual + x, weight, 1e-5), rtol=0, atol=0)


def test_silu_and_mul():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[..., :5]) * x[..., 5:])
