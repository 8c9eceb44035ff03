"""Gated activations."""

import torch
import torch.nn.functional as F

from quire.kernels import cpu_extension


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x`` is ``[..., 2 * d]`` holding ``gate`` then ``up`` (Quire's C++ kernel on
    CPUs, Triton on CUDA devices)."""
    if x.is_cuda:
        from quire.kernels.triton_ops import elementwise

        return elementwise.silu_and_mul(x)
    kernels = cpu_extension.for_tensor(x)
    if kernels is not None:
        return kernels.silu_and_mul(x)
    return silu_and_mul_reference(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul`` in PyTorch ops."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` where ``x`` is ``[..., 2 * d]`` holding ``gate`` then ``up``
    (Gemma's MLP). NOTE: PyTorch ops on every device for now (no fused kernel): two passes instead of one."""
    return gelu_tanh_and_mul_reference(x)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh_and_mul`` in PyTorch ops: the activation is rounded to ``x.dtype`` before the product, as
    transformers' ``gelu_pytorch_tanh`` MLPs compute it."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
