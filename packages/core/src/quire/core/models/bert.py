"""The BERT encoder (sentence-transformers checkpoints such as all-MiniLM-L6-v2): whole prompts in, every
token's last hidden state out, for pooling into embeddings.

Module names mirror transformers' ``BertModel``, except that q/k/v are fused into ``attention.qkv_proj`` and
``LayerNorm`` is spelled ``layer_norm`` (the registry entry's weight mapping does both); the pooler is not
built. Attention is bidirectional within each prompt: there is no KV cache, so every prompt runs whole in
one call, and the model takes no attention backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.core.config import ModelConfig
from quire.core.models.layers import Embedding, Linear
from quire.kernels import linear as linear_ops

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _layer_norm(size: int, eps: float, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(size, eps, dtype=dtype).requires_grad_(False)


def check_prompt_spans(query_start_loc: list[int], num_tokens: int) -> None:
    """``ValueError`` unless ``query_start_loc`` rises from 0 to ``num_tokens``, one or more tokens per prompt."""
    if (len(query_start_loc) < 2 or query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens
            or any(stop <= start for start, stop in zip(query_start_loc, query_start_loc[1:]))):
        raise ValueError(f"query_start_loc must rise from 0 to the {num_tokens} tokens, one or more tokens "
                         f"per prompt; got {query_start_loc}")


class BertEmbeddings(nn.Module):
    """Word + token type + absolute position embeddings, then a LayerNorm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size, dtype)
        self.token_type_embeddings = Embedding(config.num_token_types, config.hidden_size, dtype)
        self.layer_norm = _layer_norm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids)
        if token_type_ids is None:  # every token of type 0, as transformers defaults them
            embeddings = embeddings + self.token_type_embeddings.weight[0]
        else:
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return self.layer_norm(embeddings + self.position_embeddings(positions))


class DenseLayerNorm(nn.Module):
    """``layer_norm(dense(x) + residual)``: the post-norm ending of BERT's attention and MLP blocks."""

    def __init__(self, in_features: int, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, True, dtype)
        self.layer_norm = _layer_norm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dense = self.dense
        if dense.quantized is not None:
            return self.layer_norm(dense(x) + residual)
        return self.layer_norm(linear_ops.linear_add(x, dense.weight, dense.bias, residual, dense.packed))


class BertAttention(nn.Module):
    """Bidirectional multi-head self-attention within each prompt, with its output projection and LayerNorm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = Linear(config.hidden_size, 3 * config.hidden_size, True, dtype)
        self.output = DenseLayerNorm(config.hidden_size, config, dtype)

    def forward(self, hidden: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim)
        out = hidden.new_empty(num_tokens, self.num_heads * self.head_dim)
        # NOTE: one call per prompt: a padded batch spends most of its time on padding and on the copies in
        # and out of it (about 3x slower for 64 prompts of 30 to 140 tokens)
        for start, stop in zip(query_start_loc, query_start_loc[1:]):
            query, key, value = qkv[start:stop].permute(1, 2, 0, 3).unsqueeze(1)  # each [1, heads, len, head_dim]
            prompt_out = F.scaled_dot_product_attention(query, key, value)
            out[start:stop] = prompt_out[0].transpose(0, 1).reshape(stop - start, -1)
        return self.output(out, hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, True, dtype)
        self.activation = _ACTIVATIONS[config.encoder_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.dense
        if self.activation is F.gelu and dense.quantized is None:  # fused into the multiply where the kernels can
            return linear_ops.linear_gelu(x, dense.weight, dense.bias, dense.packed)
        return self.activation(dense(x))


class BertLayer(nn.Module):
    """Post-norm encoder layer: ``x = ln(x + attn(x))``, then ``x = ln(x + mlp(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(config, dtype)
        self.intermediate = BertIntermediate(config, dtype)
        self.output = DenseLayerNorm(config.intermediate_size, config, dtype)

    def forward(self, hidden: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        hidden = self.attention(hidden, query_start_loc)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """``forward`` maps a flat batch of whole prompts to every token's last hidden state ``[num_tokens,
    hidden_size]``; pooling (``quire.kernels.pooling``) turns those into one vector per prompt."""

    def __init__(self, config: ModelConfig, attention_backend: object = None):
        super().__init__()
        del attention_backend  # the registry builds every model with one; an encoder keeps no KV cache to page
        dtype = getattr(torch, config.dtype)
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = BertEncoder(config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``, ``positions`` (0 … n-1 within each prompt, below ``max_position_embeddings``) and
        ``token_type_ids`` (None: all 0) are ``[num_tokens]``; prompt ``i`` owns tokens
        ``query_start_loc[i] : query_start_loc[i + 1]`` and sees exactly those."""
        check_prompt_spans(query_start_loc, input_ids.shape[0])
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, query_start_loc)
        return hidden

    def prepack(self) -> None:
        """After loading: reorder linear weights for the device's fastest matrix multiply."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()


class BertForSequenceClassification(BertModel):
    """A cross-encoder: BERT over a text pair (``[CLS] a [SEP] b [SEP]``, token type 1 on the second text), then
    transformers' pooler (dense + tanh on ``[CLS]``) and a classifier of ``num_labels`` (1) logits. ``forward`` is
    ``BertModel``'s; ``classify(cls_hidden)`` maps ``[num_prompts, hidden_size]`` ``[CLS]`` states to logits."""

    def __init__(self, config: ModelConfig, attention_backend: object = None):
        super().__init__(config, attention_backend)
        dtype = getattr(torch, config.dtype)
        self.pooler = BertPooler(config, dtype)
        self.classifier = Linear(config.hidden_size, config.num_labels, True, dtype)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden)))


class BertPooler(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, True, dtype)
