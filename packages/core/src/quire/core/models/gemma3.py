"""The Gemma 3 text decoder (``Gemma3ForCausalLM``), as transformers computes it.

Beside Llama it has: RMSNorms that scale by ``1 + weight`` in float32 (``OffsetRMSNorm``), four per layer (the
attention and MLP outputs are normalised too, before they join the residual); the token embeddings scaled by
``sqrt(hidden_size)`` rounded to the model's dtype; per-head q/k norms; attention scaled by
``query_pre_attn_scalar ** -0.5``; a GELU (tanh) MLP; sliding-window layers (``layer_types``) that rotate by
their own rotary base among full-attention ones that rotate by ``rope``; logits optionally soft-capped.
Module names mirror the checkpoints except for Llama's fused ``qkv_proj`` and ``gate_up_proj``.

The C++ decoder stack is Llama's: decode steps run through these modules. No tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from quire.core.attention.backend import AttentionBackend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import ModelConfig, RopeConfig
from quire.core.models.layers import Embedding, Linear, OffsetRMSNorm, RotaryEmbedding
from quire.core.models.llama import LlamaMLP
from quire.kernels import linear as linear_ops
from quire.kernels.activation import gelu_tanh_and_mul
from quire.kernels.rotary import rotate

SLIDING_ATTENTION = "sliding_attention"


class Gemma3Attention(nn.Module):
    """``sliding_window``: this layer's window (None: it attends to the whole context)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int | None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.sliding_window = sliding_window
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, dtype)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.backend = backend

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = self.q_norm(query.view(-1, self.num_heads, self.head_dim))
        key = self.k_norm(key.view(-1, self.num_kv_heads, self.head_dim))
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        query, key = rotate(query, key, *rotary)
        out = self.backend.forward(query, key, value, kv_cache, metadata, self.scale,
                                   sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class Gemma3MLP(LlamaMLP):
    """Llama's gated MLP (fused gate/up, chunked on CPUs) with GELU's tanh approximation for SiLU."""

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """``is_sliding``: a sliding-attention layer (which rotates by the local base even where its window is
    as long as the context and so never slides)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, layer_index: int):
        super().__init__()
        self.is_sliding = config.layer_types[layer_index] == SLIDING_ATTENTION
        self.self_attn = Gemma3Attention(config, backend, dtype, config.layer_sliding_window(layer_index))
        self.mlp = Gemma3MLP(config, dtype)
        eps = config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)

    def forward(self, rotary, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        # NOTE: the residual sums stay in the model's dtype and each norm reads the rounded sum, as in
        # transformers (a fused add-and-norm would normalise the unrounded float32 sum).
        attended = self.self_attn(rotary, self.input_layernorm(hidden), kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed_forward = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed_forward)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        # NOTE: transformers rounds the scale to the model's dtype (sqrt(3072) = 55.43 is 55.5 in bfloat16)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope)
        self.local_rotary = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, config.max_model_len,
                                                RopeConfig(theta=config.local_rope_theta))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, backend, dtype, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids, positions, kv_caches, metadata, inputs_embeds=None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary.factors(positions, hidden.dtype)  # once per step, for every layer of its kind
        local_rotary = rotary if self.local_rotary is None else self.local_rotary.factors(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(local_rotary if layer.is_sliding else rotary, hidden, kv_cache, metadata)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    """Decoder-only causal LM: ``forward`` returns hidden states, ``compute_logits`` logits in the model's
    dtype, soft-capped where the config says so."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        dtype = getattr(torch, config.dtype)
        self.config = config
        self.model = Gemma3Model(config, backend, dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                     False, dtype)
        self._tied_head_packed: linear_ops.PackedLinear | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds`` (``[num_tokens, hidden_size]``, already scaled), when given, replaces the token
        embedding lookup."""
        return self.model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings ``forward`` would compute: ``[num_tokens, hidden_size]``."""
        return self.model.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:  # the unscaled embedding table is the head
            logits = linear_ops.linear(hidden, self.model.embed_tokens.weight, None, self._tied_head_packed)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepack(self) -> None:
        """After loading: reorder linear weights for the device's fastest matrix multiply."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        embedding = self.model.embed_tokens.weight
        if self.lm_head is None and linear_ops.can_prepack(embedding):
            self._tied_head_packed = linear_ops.prepack(embedding)  # the embedding itself stays
