"""RMSNorm, alone and with the residual add fused in front of it; Gemma's (1 + weight) variant."""

import torch

from quire.kernels import cpu_extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension (Quire's C++ kernel on CPUs, Triton on
    CUDA devices)."""
    if x.is_cuda:
        from quire.kernels.triton_ops import elementwise

        return elementwise.rms_norm(x, None, weight, eps)[0]
    kernels = cpu_extension.for_tensor(x)
    if kernels is not None:
        return kernels.rms_norm(x.contiguous(), None, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``; the sum is taken in ``x.dtype``."""
    if x.is_cuda:
        from quire.kernels.triton_ops import elementwise

        return elementwise.rms_norm(x, residual, weight, eps)
    kernels = cpu_extension.for_tensor(x)
    if kernels is not None:
        out, summed = kernels.rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
        return out, summed
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by ``1 + weight`` (Gemma's convention: weights are stored centred on 0).

    NOTE: normalisation and scaling both happen in float32 and the result is rounded to ``x.dtype`` once, at
    the end (Llama rounds before the weight): the ``rms_norm`` kernel run on float32 inputs computes exactly
    that order.
    """
    return rms_norm(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, in PyTorch ops.

    NOTE: the statistics are computed in float32 and the result is cast back to ``x.dtype`` before the
    weight is applied; this is the order Hugging Face Llama uses, so bfloat16 results match it bit for bit.
    """
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` in PyTorch ops."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def offset_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``offset_rms_norm`` in PyTorch ops, in transformers' Gemma 3 order."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)
