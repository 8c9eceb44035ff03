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
