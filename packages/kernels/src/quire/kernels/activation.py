"""Gated activations."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x`` is ``[..., 2 * d]`` holding ``gate`` then ``up``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
