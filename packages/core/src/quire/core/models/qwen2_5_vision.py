"""Qwen2.5-VL's vision transformer: one image's patches in, its merged patch embeddings out.

Module names mirror the Hub's checkpoints (``visual.``), except that each block's MLP fuses gate/up into
``gate_up_proj`` (the registry entry's weight mapping stacks them). The processor lays an image's patches out
merge block by merge block (``spatial_merge_size`` squared patches become one token); the tower reorders those
blocks window by window, so windowed layers attend within contiguous runs::

    merged grid 3 x 5, windows of 2 x 2:   window order of the 15 merge blocks:
    +-------+-------+---+
    | 0  1  | 2  3  | 4 |                  0 1 5 6 | 2 3 7 8 | 4 9 | 10 11 | 12 13 | 14
    | 5  6  | 7  8  | 9 |
    +-------+-------+---+
    | 10 11 | 12 13 |14 |
    +-------+-------+---+

and puts the merged tokens back in the processor's order at the end.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from quire.core.models.layers import Linear, RMSNorm
from quire.kernels.activation import silu_and_mul
from quire.kernels.rotary import rope_inv_freq, rotate_reference

VISION_NORM_EPS = 1e-6  # transformers' Qwen2.5-VL vision RMSNorms, whatever the config says


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """The tower's shape, as ``multimodal_config["vision_config"]`` holds it (see ``qwen2_5_vl_fields``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: list[int]
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged token."""
        return self.spatial_merge_size**2

    @property
    def window_blocks(self) -> int:
        """A window's side, in merge blocks."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def patch_positions(grid: tuple[int, int, int], merge_size: int) -> torch.Tensor:
    """``[t*h*w, 2]`` (row, column) of every patch, in the processor's merge-block order, repeated per frame."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge_size, merge_size, 1, 1).expand(-1, -1, w // merge_size, merge_size)
    columns = torch.arange(w).view(1, 1, w // merge_size, merge_size).expand(h // merge_size, merge_size, -1, -1)
    rows, columns = rows.transpose(1, 2).flatten(), columns.transpose(1, 2).flatten()
    return torch.stack([rows, columns], dim=-1).repeat(t, 1)


def window_order(grid: tuple[int, int, int], merge_size: int, window_blocks: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of an image in window order (indices into the processor's order) and each window's
    number of merge blocks; windows tile every frame from the top left, those at the edges cut short."""
    t, h, w = grid
    h, w = h // merge_size, w // merge_size
    blocks = torch.arange(t * h * w).view(t, h, w)
    order, lengths = [], []
    for frame in blocks:
        for top in range(0, h, window_blocks):
            for left in range(0, w, window_blocks):
                window = frame[top:top + window_blocks, left:left + window_blocks].flatten()
                order.append(window)
                lengths.append(window.numel())
    return torch.cat(order), lengths


class QwenVisionRotary(nn.Module):
    """2-D rotary factors: half of each head's frequencies follow the patch's row, half its column."""

    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        with torch.device("cpu"):  # NOTE: the same float32 frequencies on every device, as transformers computes them
            inv_freq = rope_inv_freq(config.head_dim // 2, config.rope_theta)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n, 2]`` → float32 ``(cos, sin)``, each ``[n, head_dim / 2]``."""
        freqs = (positions.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq).flatten(1)
        return freqs.cos(), freqs.sin()


class QwenVisionAttention(nn.Module):
    """Bidirectional attention within each segment (a window, or a whole frame)."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, True, dtype)
        self.proj = Linear(config.hidden_size, config.hidden_size, True, dtype)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                segment_lengths: list[int]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        # NOTE: rotated in float32 and rounded back, as transformers does
        query, key = (x.to(hidden.dtype) for x in rotate_reference(query.float(), key.float(), *rotary))
        out = torch.empty_like(query)
        for length, starts in _segments_by_length(segment_lengths).items():
            rows = (torch.tensor(starts, device=hidden.device)[:, None]
                    + torch.arange(length, device=hidden.device)).flatten()
            q, k, v = (x[rows].view(len(starts), length, self.num_heads, self.head_dim).transpose(1, 2)
                       for x in (query, key, value))
            attended = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
            out[rows] = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return self.proj(out.view(num_tokens, -1))


def _segments_by_length(lengths: list[int]) -> dict[int, list[int]]:
    """Start offsets of consecutive segments, grouped by length (segments of one length attend in one batch)."""
    grouped, start = defaultdict(list), 0
    for length in lengths:
        grouped[length].append(start)
        start += length
    return grouped


class QwenVisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, True, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class QwenVisionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, VISION_NORM_EPS, dtype)
        self.norm2 = RMSNorm(config.hidden_size, VISION_NORM_EPS, dtype)
        self.attn = QwenVisionAttention(config, dtype)
        self.mlp = QwenVisionMLP(config, dtype)

    def forward(self, hidden, rotary, segment_lengths):
        hidden = hidden + self.attn(self.norm1(hidden), rotary, segment_lengths)
        return hidden + self.mlp(self.norm2(hidden))


class QwenPatchMerger(nn.Module):
    """RMSNorm, then each merge block's patches side by side through ``Linear, GELU, Linear``."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.merged_size = config.hidden_size * config.merge_unit
        self.ln_q = RMSNorm(config.hidden_size, VISION_NORM_EPS, dtype)
        self.mlp = nn.Sequential(Linear(self.merged_size, self.merged_size, True, dtype), nn.GELU(),
                                 Linear(self.merged_size, config.out_hidden_size, True, dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(hidden).view(-1, self.merged_size))


class QwenPatchEmbed(nn.Module):
    """A Conv3d with stride = kernel (temporal_patch_size x patch_size x patch_size) over one patch per row,
    computed as the matrix multiply it is."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False,
                              dtype=dtype).requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.device, weight.dtype), weight.flatten(1))


class QwenVisionTransformer(nn.Module):
    """``forward(pixel_values, grid)`` → the image's merged tokens ``[t*h*w / merge_unit, out_hidden_size]``."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.patch_embed = QwenPatchEmbed(config, dtype)
        self.rotary = QwenVisionRotary(config)
        self.blocks = nn.ModuleList(QwenVisionBlock(config, dtype) for _ in range(config.depth))
        self.merger = QwenPatchMerger(config, dtype)

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``pixel_values [t*h*w, in_channels * temporal_patch_size * patch_size**2]`` as the processor made
        them for one image whose patch grid is ``grid`` (t, h, w)."""
        config = self.config
        t, h, w = grid
        if h % config.spatial_merge_size or w % config.spatial_merge_size:
            raise ValueError(f"image grid {grid} does not divide into {config.spatial_merge_size}-patch merge blocks")
        if pixel_values.shape[0] != t * h * w:
            raise ValueError(f"{pixel_values.shape[0]} rows of pixel_values for an image grid of {grid}")
        order, window_lengths = window_order(grid, config.spatial_merge_size, config.window_blocks)
        unit = config.merge_unit
        patch_order = (order[:, None] * unit + torch.arange(unit)).flatten().to(pixel_values.device)
        hidden = self.patch_embed(pixel_values)[patch_order]
        rotary = self.rotary(patch_positions(grid, config.spatial_merge_size).to(pixel_values.device)[patch_order])
        window_lengths = [length * unit for length in window_lengths]
        frame_lengths = [h * w] * t
        for index, block in enumerate(self.blocks):
            is_full = index in config.fullatt_block_indexes
            hidden = block(hidden, rotary, frame_lengths if is_full else window_lengths)
        merged = self.merger(hidden)
        out = torch.empty_like(merged)
        out[order.to(merged.device)] = merged  # back to the processor's order
        return out
