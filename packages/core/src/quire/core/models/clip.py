"""The CLIP vision transformer as vision-language models use it: one image in, one layer's hidden states out.

Module names mirror transformers 5.x's ``CLIPVisionModel``, except that q/k/v are fused into ``qkv_proj``
(the registry entry's weight mapping stacks them). Only the encoder layers up to the requested hidden state
are built; the pooled output (``post_layernorm``) is not.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from quire.core.models.layers import Embedding, Linear


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
    """The tower's shape, as ``vision_config`` in config.json gives it (``hidden_act``: quick_gelu or gelu)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's sigmoid approximation of GELU (transformers' ``QuickGELUActivation``)."""
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu}


class ClipVisionEmbeddings(nn.Module):
    """Patches (a convolution with stride = kernel = patch size), a class token in front, learned positions."""

    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.image_size = config.image_size
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, bias=False, dtype=dtype).requires_grad_(False)
        self.position_embedding = Embedding(config.num_patches + 1, config.hidden_size, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[3, image_size, image_size]`` → ``[1 + num_patches, hidden_size]``."""
        if tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values of {tuple(pixel_values.shape[-2:])} do not match the vision tower's "
                             f"{self.image_size}x{self.image_size} images")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.device, weight.dtype).unsqueeze(0))
        patches = patches.flatten(2)[0].transpose(0, 1)  # [hidden, grid, grid] -> [grid * grid, hidden]
        embeddings = torch.cat([self.class_embedding.unsqueeze(0), patches])
        positions = torch.arange(embeddings.shape[0], device=embeddings.device)
        return embeddings + self.position_embedding(positions)


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens."""

    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = Linear(config.hidden_size, 3 * config.hidden_size, True, dtype)
        self.out_proj = Linear(config.hidden_size, config.hidden_size, True, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.permute(1, 2, 0, 3)  # each [heads, tokens, head_dim]
        out = F.scaled_dot_product_attention(query, key, value, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(0, 1).reshape(num_tokens, -1))


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, True, dtype)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, True, dtype)
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-norm transformer layer: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = ClipAttention(config, dtype)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype).requires_grad_(False)
        self.mlp = ClipMLP(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype).requires_grad_(False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class ClipEncoder(nn.Module):
    def __init__(self, config: ClipVisionConfig, num_layers: int, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config, dtype) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """``forward(pixel_values)`` returns, per image, hidden state ``feature_layer`` of transformers'
    ``hidden_states`` (0: the embeddings after ``pre_layrnorm``; k: the output of encoder layer k - 1), so
    only ``feature_layer`` encoder layers are built and run."""

    def __init__(self, config: ClipVisionConfig, feature_layer: int, dtype: torch.dtype):
        super().__init__()
        if not 0 <= feature_layer <= config.num_hidden_layers:
            raise ValueError(f"feature layer {feature_layer} is outside the tower's {config.num_hidden_layers} layers")
        self.embeddings = ClipVisionEmbeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype).requires_grad_(False)
        self.encoder = ClipEncoder(config, feature_layer, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, channels, image_size, image_size]`` → ``[num_images, 1 + num_patches, hidden_size]``
        (images run one at a time: each attends only to itself)."""
        return torch.stack([self._forward_one(image) for image in pixel_values])

    def _forward_one(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return hidden
