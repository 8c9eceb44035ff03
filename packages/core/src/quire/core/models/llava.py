"""LLaVA-1.5: CLIP image features, projected into a Llama-shaped language model's embedding space.

The model runner embeds a prompt's tokens (``embed_input_ids``), puts each image's ``embed_multimodal`` rows
at its placeholder tokens, and runs ``forward`` with those ``inputs_embeds``; text-only steps may pass token
ids alone. Module names follow the registry entry's weight mapping (``architectures.LLAVA_WEIGHTS``):
``language_model`` (a ``LlamaForCausalLM``), ``vision_tower``, ``multi_modal_projector``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.core.attention.backend import AttentionBackend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import ModelConfig
from quire.core.models.clip import ClipVisionConfig, ClipVisionTower
from quire.core.models.layers import Linear
from quire.core.models.llama import LlamaForCausalLM


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(gelu(linear_1(features)))``: vision hidden size → text hidden size."""

    def __init__(self, vision_hidden_size: int, text_hidden_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = Linear(vision_hidden_size, text_hidden_size, bias, dtype)
        self.linear_2 = Linear(text_hidden_size, text_hidden_size, bias, dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module):
    """A vision-language model: ``embed_multimodal`` turns one image into embeddings of the language model's
    width; ``forward`` and ``compute_logits`` are the language model's (``LlamaForCausalLM``)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        dtype = getattr(torch, config.dtype)
        settings = config.multimodal_config
        vision = ClipVisionConfig(**settings["vision_config"])
        self.config = config
        self.drops_class_token = settings["vision_feature_select_strategy"] == "default"
        self.vision_tower = ClipVisionTower(vision, settings["vision_feature_layer"], dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(vision.hidden_size, config.hidden_size,
                                                              settings["projector_bias"], dtype)
        self.language_model = LlamaForCausalLM(config, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``: ``inputs_embeds``, when given, replaces the token embeddings."""
        return self.language_model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """``data["pixel_values"]``: ``[1, 3, H, W]`` float32 as the checkpoint's processor made it for one
        image → ``[num_image_tokens, hidden_size]`` in the model's dtype, the rows of its placeholder tokens
        (transformers' ``get_image_features``, flattened)."""
        if modality != "image":
            raise ValueError(f"LLaVA embeds images, not {modality!r}")
        features = self.vision_tower(data["pixel_values"])
        if self.drops_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features.flatten(0, 1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def prepack(self) -> None:
        """After loading: reorder linear weights for the device's fastest matrix multiply (the language
        model also builds its decoder stack)."""
        for module in (*self.vision_tower.modules(), *self.multi_modal_projector.modules()):
            if isinstance(module, Linear):
                module.prepack()
        self.language_model.prepack()
