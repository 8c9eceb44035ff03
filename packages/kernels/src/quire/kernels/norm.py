"""RMSNorm, alone and with the residual add fused in front of it."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension.

    NOTE: the statistics are computed in float32 and the result is cast back to ``x.dtype`` before the
    weight is applied; this is the order Hugging Face Llama uses, so bfloat16 results match it bit for bit.
    """
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``; the sum is taken in ``x.dtype``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
