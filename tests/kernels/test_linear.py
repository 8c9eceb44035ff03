import pytest
import torch

from quire.kernels import cpu_extension
from quire.kernels import linear as linear_ops

CPU_KERNELS = cpu_extension.load()
needs_kernels = pytest.mark.skipif(CPU_KERNELS is None, reason="Quire's C++ CPU kernels could not be built here")


def reference(x, weight, bias):
    """A bfloat16 GEMM with float32 accumulation, rounded once."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 64, 67])
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (49, 70), (50, 8), (7, 3)])
def test_linear_bf16_kernel_equals_float32_accumulation(rows, out_features, in_features):
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    for b in (bias, None):
        got = CPU_KERNELS.linear_bf16(x, weight, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # the same products summed in another order: at most one bfloat16 rounding step apart
        expected = reference(x, weight, b)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
        exact_fraction = (got == expected).float().mean().item()
        assert exact_fraction > 0.95, exact_fraction
    # float32 activations keep a float32 output (no rounding at all)
    got = CPU_KERNELS.linear_bf16(x.float(), weight, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ weight.float().T + bias.float(), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_linear_bf16_kernel_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        CPU_KERNELS.linear_bf16(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        CPU_KERNELS.linear_bf16(torch.zeros(2, 8), torch.zeros(4, 8), None)


def test_bf16_path_follows_the_cpu():
    path = linear_ops.bf16_path()
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if onednn_bf16:
        assert path == "onednn"
    elif CPU_KERNELS is not None and CPU_KERNELS.linear_bf16_vectorized():
        assert path == "kernel"
    else:
        assert path == "torch"
    weight = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert linear_ops.can_prepack(weight) == (path != "torch")
    assert not linear_ops.can_prepack(weight.float())


@pytest.mark.skipif(not linear_ops.can_prepack(torch.zeros(1, 1, dtype=torch.bfloat16)),
                    reason="no prepacked bfloat16 path on this CPU")
@pytest.mark.parametrize("rows", [1, 13, 130])
def test_prepacked_linear_equals_float32_accumulation(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    weight = torch.randn(80, 96).to(torch.bfloat16)
    bias = torch.randn(80).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    got = linear_ops.linear(x, None, bias, packed)
    torch.testing.assert_close(got.float(), reference(x, weight, bias).float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gelu_and_residual_add_match_the_unfused_ops(dtype):
    from quire.kernels.linear import can_prepack, linear, linear_add, linear_gelu, prepack

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=generator).to(dtype)
    weight = (torch.randn(96, 64, generator=generator) * 0.2).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    residual = torch.randn(37, 96, generator=generator).to(dtype)
    packed = prepack(weight) if can_prepack(weight) else None
    reference = x.float() @ weight.float().T + bias.float()
    tolerance = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    torch.testing.assert_close(linear_gelu(x, weight, bias, packed).float(),
                               torch.nn.functional.gelu(reference), **tolerance)
    torch.testing.assert_close(linear_add(x, weight, bias, residual, packed).float(),
                               reference + residual.float(), **tolerance)
    torch.testing.assert_close(linear(x, weight, bias, packed).float(), reference, **tolerance)
