"""Building blocks shared by the model implementations; the arithmetic lives in ``quire.kernels``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.core.config import RopeConfig
from quire.kernels import linear as linear_ops
from quire.kernels import quant
from quire.kernels.norm import fused_add_rms_norm, offset_rms_norm, rms_norm
from quire.kernels.rotary import rope_cos_sin, rope_inv_freq, rotary_factors


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialised parameters (they are always loaded from a checkpoint).

    A quantized layer (``set_quantized``: GGUF blocks, or ``--quantization int8``) has no float weight: it
    holds row segments of ``QuantizedWeight`` whose outputs are concatenated.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed: linear_ops.PackedLinear | None = None
        self.quantized: list[quant.QuantizedWeight] | None = None

    def set_quantized(self, segments: list[quant.QuantizedWeight]) -> None:
        """Compute on ``segments`` (stacked along the output rows) instead of a float weight."""
        self.quantized = segments
        self.weight = None

    def prepack(self) -> None:
        """Prepare the loaded weight for the fastest matrix multiply the device has (a no-op if none)."""
        if self.weight is not None and linear_ops.can_prepack(self.weight):
            self.packed = linear_ops.prepack(self.weight)
            self.weight = None  # the packed form holds what it needs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized_linear(x, self.quantized, self.bias)
        return linear_ops.linear(x, self.weight, self.bias, self.packed)


def quantized_linear(x: torch.Tensor, segments: list[quant.QuantizedWeight],
                     bias: torch.Tensor | None) -> torch.Tensor:
    if len(segments) == 1:
        return quant.quant_linear(x, segments[0], bias)
    out = torch.cat([quant.quant_linear(x, segment) for segment in segments], dim=-1)
    return out if bias is None else out + bias


def quantize_int8(model: nn.Module) -> None:
    """``--quantization int8``: every float linear layer becomes int8 weights with one scale per output row."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.set_quantized([quant.quantize_int8(module.weight.data)])


class Embedding(nn.Module):
    """Token embedding table ``[vocab_size, hidden_size]``; a quantized table (GGUF) dequantizes the rows
    a step looks up."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.dtype = dtype
        self.quantized: quant.QuantizedWeight | None = None

    def set_quantized(self, segments: list[quant.QuantizedWeight]) -> None:
        if len(segments) != 1:
            raise ValueError("an embedding table is one quantized tensor")
        self.quantized = segments[0]
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quant.dequantize(self.quantized, input_ids).to(self.dtype)
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it adds it first and also returns the sum (the new residual)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (checkpoints store the weight centred on 0), in float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Holds the float32 cos/sin table for every position up to ``max_positions``, for the leading
    ``rotary_dim`` dimensions of each head (all of them unless ``rope.partial_rotary_factor`` < 1)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.rotary_dim = rope.rotary_dim(head_dim)
        device = torch.get_default_device()  # the model's device (ModelRunner builds it under one)
        with torch.device("cpu"):  # NOTE: the same float32 table on every device, as transformers computes it
            inv_freq = rope_inv_freq(
                self.rotary_dim, rope.theta, rope.rope_type, rope.factor, rope.low_freq_factor,
                rope.high_freq_factor, rope.original_max_position_embeddings, rope.short_factor,
                rope.long_factor, max_positions,
            )
            table = rope_cos_sin(inv_freq, max_positions, rope.attention_factor)
        self.register_buffer("cos_sin", table.to(device), persistent=False)

    def factors(self, positions: torch.Tensor, dtype: torch.dtype):
        """``(cos, sin)`` for this step's positions, shared by every layer."""
        return rotary_factors(positions, self.cos_sin, dtype)
