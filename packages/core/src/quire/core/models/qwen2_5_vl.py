"""Qwen2.5-VL: a windowed vision transformer (``qwen2_5_vision``) in front of a Qwen2 language model that
rotates queries and keys by three position rows (M-RoPE).

The model runner embeds a prompt's tokens (``embed_input_ids``), puts each image's ``embed_multimodal`` rows at
its placeholder tokens, and runs ``forward`` with ``positions`` of shape ``[3, num_tokens]`` (t, h, w rows,
``mrope_positions`` for a prompt; equal rows for text); 1-D positions are read as three equal rows. Module
names follow the registry entry's weight mapping (``architectures.QWEN2_5_VL_WEIGHTS``): ``visual`` and
``language_model`` (a ``LlamaForCausalLM`` whose rotary table is ``MRotaryEmbedding``).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from quire.core.attention.backend import AttentionBackend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import ModelConfig, RopeConfig
from quire.core.models import mrope
from quire.core.models.layers import Linear, RotaryEmbedding
from quire.core.models.llama import LlamaForCausalLM
from quire.core.models.qwen2_5_vision import QwenVisionConfig, QwenVisionTransformer


class MRotaryEmbedding(RotaryEmbedding):
    """The rotary table of a text model, read by three position rows: of each head's ``head_dim / 2``
    frequencies, the first ``mrope_section[0]`` follow the t row, the next ``mrope_section[1]`` the h row and
    the last ``mrope_section[2]`` the w row (the second half of the head mirrors the first, as in rotate-half)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, mrope_section: list[int]):
        super().__init__(head_dim, max_positions, rope)
        bounds = list(itertools.accumulate(mrope_section, initial=0))
        self.sections = list(zip(bounds, bounds[1:]))

    def factors(self, positions: torch.Tensor, dtype: torch.dtype):
        """``(cos, sin)``, each ``[num_tokens, head_dim / 2]``, for ``positions [3, num_tokens]`` (or
        ``[num_tokens]``: three equal rows)."""
        if positions.dim() == 1:
            return super().factors(positions, dtype)
        half = self.cos_sin.shape[-1] // 2
        rows = self.cos_sin.index_select(0, positions.flatten()).view(3, positions.shape[1], -1)
        cos = torch.cat([rows[row, :, start:end] for row, (start, end) in enumerate(self.sections)], dim=-1)
        sin = torch.cat([rows[row, :, half + start:half + end] for row, (start, end) in enumerate(self.sections)],
                        dim=-1)
        return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    """A vision-language model: ``embed_multimodal`` turns one image into embeddings of the language model's
    width; ``forward`` and ``compute_logits`` are the language model's, rotating by M-RoPE positions."""

    # The runner gives this model ``[3, num_tokens]`` positions from ``mrope_positions``.
    uses_mrope = True

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        dtype = getattr(torch, config.dtype)
        settings = config.multimodal_config
        self.config = config
        self.vision_config = QwenVisionConfig(**settings["vision_config"])
        self.visual = QwenVisionTransformer(self.vision_config, dtype)
        rotary = MRotaryEmbedding(config.head_dim, config.max_model_len, config.rope, settings["mrope_section"])
        self.language_model = LlamaForCausalLM(config, backend, rotary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``, with ``positions`` ``[3, num_tokens]`` (t, h, w) or ``[num_tokens]``
        (text: the three rows are equal)."""
        return self.language_model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image as its processor made it: ``data["pixel_values"]`` ``[t*h*w, C * T * P * P]`` float32 and
        ``data["image_grid_thw"]`` ``[1, 3]`` → ``[t*h*w / merge_size**2, hidden_size]`` in the model's dtype,
        the rows of its placeholder tokens (transformers' ``get_image_features``)."""
        if modality != "image":
            raise ValueError(f"Qwen2.5-VL embeds images, not {modality!r}")
        grid = data["image_grid_thw"].reshape(-1).tolist()
        if len(grid) != 3:
            raise ValueError(f"image_grid_thw must be one (t, h, w) row, got {len(grid)} values")
        return self.visual(data["pixel_values"], tuple(int(n) for n in grid))

    def mrope_positions(self, token_ids: list[int], image_grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
        """``[3, len(token_ids)]`` int64 positions of a prompt holding the images of ``image_grids`` (their
        ``image_grid_thw`` rows, in placeholder order), and the delta of the tokens after it (a token at sequence
        index ``p`` has position ``p + delta`` on every row); see ``models.mrope``."""
        return mrope.mrope_positions(token_ids, image_grids, self.config.image_token_id,
                                     self.vision_config.spatial_merge_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def prepack(self) -> None:
        """After loading: reorder linear weights for the device's fastest matrix multiply (the language
        model also builds its decoder stack)."""
        for module in self.visual.modules():
            if isinstance(module, Linear):
                module.prepack()
        self.language_model.prepack()
