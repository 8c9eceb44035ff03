"""The Llama decoder, which also serves Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and Phi-3 checkpoints.

Module names mirror the Hugging Face checkpoints, except that q/k/v projections are fused into
``qkv_proj`` and gate/up into ``gate_up_proj`` (the registry entry's weight mapping stacks them; Phi-3's
checkpoints hold them fused already).

Given a ``TensorParallelGroup`` of several ranks, the model is built from the config's shard
(``ModelConfig.shard``: this rank's heads and MLP columns) with the layers of ``parallel_layers``: one
all-reduce after attention, one after the MLP, and a vocabulary split between the ranks. Without one it is
built from the plain layers, as a single process runs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quire.core.attention.backend import AttentionBackend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import ModelConfig
from quire.core.distributed.group import TensorParallelGroup
from quire.core.models.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, quantized_linear
from quire.core.models.parallel_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    parallel_lm_head,
    split_output_rows,
)
from quire.kernels import decode_stack, greedy_head
from quire.kernels import linear as linear_ops
from quire.kernels.activation import silu_and_mul
from quire.kernels.rotary import rotate


def _output_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                   group: TensorParallelGroup | None) -> Linear:
    """A layer whose inputs are split over the group (o_proj, down_proj): row-parallel, or plain without one."""
    if group is None:
        return Linear(in_features, out_features, bias, dtype)
    return RowParallelLinear(in_features, out_features, bias, dtype, group)


def _input_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                  group: TensorParallelGroup | None) -> Linear:
    """A layer whose outputs are split over the group (qkv_proj, gate_up_proj)."""
    linear = Linear(in_features, out_features, bias, dtype)
    return linear if group is None else split_output_rows(linear)


class LlamaAttention(nn.Module):
    """``sliding_window``: this layer's window (``ModelConfig.layer_sliding_window``), None: every earlier token."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 group: TensorParallelGroup | None = None, sliding_window: int | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = _input_linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype,
                                      group)
        self.o_proj = _output_linear(self.q_size, config.hidden_size, config.o_proj_bias, dtype, group)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.backend = backend
        self.sliding_window = sliding_window

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(-1, self.num_heads, self.head_dim)
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotate(query, key, *rotary)
        out = self.backend.forward(query, key, value, kv_cache, metadata, self.scale,
                                   sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


CPU_MLP_CHUNK_ROWS = 512
# NOTE: where oneDNN multiplies bfloat16 natively, 512 rows keep its kernels below their rate (a prefill of 32 prompts
# of 128 tokens in SmolLM2-135M on two AMD Zen 4 cores with AVX-512 BF16, chunk sizes alternated in one process: 1,246
# tok/s at 512 rows, 1,384 at 1,024, 1,404 at 2,048; on AMX tiles SmolLM2-135M's linear layers on two Intel cores:
# 1,600 GFLOP/s at 512 rows, 2,360 at 2,048; a step of 16 prompts of 128 tokens went from 408-493 to 337-373 ms), but
# the intermediate must stay small: the chunks are the most rows, a power of two up to NATIVE_BF16_MLP_CHUNK_ROWS,
# whose intermediate ([rows, 2 * intermediate_size]) fits in NATIVE_BF16_MLP_INTERMEDIATE_BYTES. One MLP over 2,048
# rows, chunk by chunk, on the AMX machine (ms; the intermediate's MiB): SmolLM2-135M (intermediate 1,536) 7.6 at 512
# rows (3), 6.7 at 1,024 (6), 5.3 at 2,048 (12); Qwen2.5-0.5B (4,864) 26.1 at 512 (10), 35.7 at 1,024 (19);
# Qwen2.5-1.5B (8,960) 85.1 at 256 (9), 91.7 at 512 (18), 148 at 1,024 (35: over glibc's largest mmap threshold,
# mapped and faulted in afresh each time); TinyLlama (5,632) 71.2 at 256 (6), 75.0 at 512 (11), 72.6 at 1,024 (22).
# Prefill of 64 prompts of 128 tokens in Qwen2.5-0.5B's shape: 1,681-1,746 tokens/s at 1,024 rows, 2,165-2,172 at 512.
NATIVE_BF16_MLP_CHUNK_ROWS = 2048
NATIVE_BF16_MLP_INTERMEDIATE_BYTES = 16 << 20


def cpu_mlp_chunk_rows(intermediate_size: int, dtype: torch.dtype) -> int:
    """Rows per chunk of a long CPU step's MLP: ``CPU_MLP_CHUNK_ROWS``, or where oneDNN multiplies bfloat16
    natively (AMX tiles, AVX-512 BF16) the most rows (a power of two, 16 to ``NATIVE_BF16_MLP_CHUNK_ROWS``) whose
    intermediate fits in ``NATIVE_BF16_MLP_INTERMEDIATE_BYTES``."""
    if not (dtype == torch.bfloat16 and linear_ops.native_bf16_matmul()):
        return CPU_MLP_CHUNK_ROWS
    bytes_per_row = 2 * intermediate_size * dtype.itemsize
    rows = NATIVE_BF16_MLP_CHUNK_ROWS
    while rows > 16 and rows * bytes_per_row > NATIVE_BF16_MLP_INTERMEDIATE_BYTES:
        rows //= 2
    return rows


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, group: TensorParallelGroup | None = None):
        super().__init__()
        self.gate_up_proj = _input_linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, group)
        self.down_proj = _output_linear(config.intermediate_size, config.hidden_size, False, dtype, group)
        # Rows per chunk of a long CPU step (None: one piece; LoRA layers index the step's rows whole).
        self.chunk_rows: int | None = cpu_mlp_chunk_rows(config.intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and self.chunk_rows is not None and x.shape[0] > self.chunk_rows:
            # NOTE: glibc maps every allocation over 32 MiB afresh, so a prompt-sized intermediate
            # ([tokens, 2 * intermediate]) costs page faults worth as much as its matrix multiply; chunks
            # of rows keep the intermediates small and in cache (1.7x faster for 2,048 tokens on AVX2).
            out = torch.empty_like(x)
            for start in range(0, x.shape[0], self.chunk_rows):
                out[start:start + self.chunk_rows] = self._forward(x[start:start + self.chunk_rows])
            return out
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 group: TensorParallelGroup | None = None, *, mlp: nn.Module | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, dtype, group, sliding_window)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, dtype, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, rotary, hidden, residual, kv_cache, metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """``rotary``: the rotary table ``forward`` reads positions from (default: ``RotaryEmbedding`` of the config's
    rope; Qwen2.5-VL gives its M-RoPE one). ``group``: the tensor-parallel ranks (see the module docstring).
    ``mlp(layer_index)``: the feed-forward block of that layer in place of ``LlamaMLP`` (mixtures of experts)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 rotary: RotaryEmbedding | None = None, group: TensorParallelGroup | None = None, *,
                 mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = (Embedding(config.vocab_size, config.hidden_size, dtype) if group is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, group))
        self.rotary = rotary if rotary is not None else RotaryEmbedding(config.head_dim, config.max_model_len,
                                                                        config.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, dtype, group, mlp=mlp(index) if mlp is not None else None,
                              sliding_window=config.layer_sliding_window(index))
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.config = config
        self.backend = backend
        self.group = group
        # Set by ``build_decode_stack`` after prepacking, where the CPU's kernels allow it: decode steps then
        # run every layer in one C++ call.
        self.decode_stack = None

    def forward(self, input_ids, positions, kv_caches, metadata, inputs_embeds=None) -> torch.Tensor:
        """``inputs_embeds`` (``[num_tokens, hidden_size]``), when given, replaces the token embedding lookup."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary.factors(positions, hidden.dtype)  # once per step, for every layer
        # (a step of more rows than an MLP chunk keeps the modules, whose MLP runs it in chunks)
        if self.decode_stack is not None and hidden.shape[0] <= CPU_MLP_CHUNK_ROWS:
            stack_inputs = self.backend.decode_stack_inputs(metadata)  # None unless every token is a decode
            if stack_inputs is not None:
                block_tables, seq_lens = stack_inputs
                return self.decode_stack.forward(hidden, kv_caches, block_tables, seq_lens, metadata.slot_mapping,
                                                 *rotary)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rotary, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def build_decode_stack(self) -> None:
        """After prepacking: hand the layers to ``quire.kernels.decode_stack`` if every linear layer is
        prepacked for the CPU (bfloat16 on the ``kernel`` or ``onednn`` path, or quantized weights) and the
        attention backend offers the stack (``cpu_decode_stack``); otherwise decode steps keep going through the
        modules (always with tensor parallelism: the stack has no collectives)."""
        if not self.backend.capabilities.cpu_decode_stack or self.group is not None:
            return
        if not all(isinstance(layer.mlp, LlamaMLP) for layer in self.layers):
            return  # the stack computes dense MLPs only
        if any(layer.self_attn.sliding_window is not None for layer in self.layers):
            return  # the stack's attention sees whole contexts (no sliding window)
        if self.rotary.cos_sin.shape[-1] != self.config.head_dim:
            return  # the stack rotates whole heads (no partial rotary)
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = {"qkv": _stack_weight(attn.qkv_proj), "o_proj": _stack_weight(attn.o_proj),
                       "gate_up": _stack_weight(mlp.gate_up_proj), "down": _stack_weight(mlp.down_proj)}
            if any(weight is None for weight in weights.values()):
                return
            layers.append({**weights, "input_norm": layer.input_layernorm.weight,
                           "post_norm": layer.post_attention_layernorm.weight,
                           "qkv_bias": attn.qkv_proj.bias, "o_bias": attn.o_proj.bias,
                           "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
                           "k_norm": attn.k_norm.weight if attn.k_norm is not None else None})
        config = self.config
        self.decode_stack = decode_stack.build(layers, self.norm.weight, config.num_attention_heads,
                                               config.num_key_value_heads, config.head_dim, config.rms_norm_eps,
                                               config.head_dim**-0.5)


def _stack_weight(linear: Linear):
    """What the C++ decoder stack computes a linear layer with: its quantized row segments (CPU tensors), its
    prepacked bfloat16 weight (``kernel`` or ``onednn`` path), or None when it can do neither."""
    if linear.quantized is not None:
        return linear.quantized if all(w.data.is_cpu for w in linear.quantized) else None
    return decode_stack.kernel_weight(linear.packed)


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM: ``forward`` returns hidden states, ``compute_logits`` logits
    in the model's dtype (``rotary``, ``mlp``: see ``LlamaModel``).

    ``tensor_parallel_group``: the ranks this model is split over, each built from ``config.shard(N)``; every
    rank gets the whole logits. None (or one rank): the plain single-process model.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding | None = None,
                 tensor_parallel_group: TensorParallelGroup | None = None, *,
                 mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        dtype = getattr(torch, config.dtype)
        group = tensor_parallel_group if tensor_parallel_group and tensor_parallel_group.world_size > 1 else None
        self.config = config
        self.group = group
        self.model = LlamaModel(config, backend, dtype, rotary, group, mlp=mlp)
        if config.tie_word_embeddings:
            self.lm_head = None
        elif group is None:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        else:
            self.lm_head = parallel_lm_head(config.vocab_size, config.hidden_size, dtype, group)
        self._tied_head_packed: linear_ops.PackedLinear | None = None
        # Set by ``prepack`` where the CPU's kernels can name a plain greedy step's tokens without every logit
        # (``quire.kernels.greedy_head``): the runner then calls ``greedy_tokens`` for up to this many rows.
        self._greedy_head: greedy_head.GreedyHead | None = None
        self.greedy_token_rows = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds`` (``[num_tokens, hidden_size]`` in the model's dtype), when given, replaces the
        token embedding lookup (prompts whose image placeholders carry image embeddings)."""
        return self.model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``forward`` would look up: ``[num_tokens, hidden_size]``."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(hidden)
        return logits if self.group is None else gather_logits(logits, self.config.vocab_size, self.group)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        embedding = self.model.embed_tokens
        if embedding.quantized is not None:
            return quantized_linear(hidden, [embedding.quantized], None)
        return linear_ops.linear(hidden, embedding.weight, None, self._tied_head_packed)

    def prepack(self) -> None:
        """After loading: reorder linear weights for the device's fastest matrix multiply."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        embedding = self.model.embed_tokens.weight
        if self.lm_head is None and embedding is not None and linear_ops.can_prepack(embedding):
            self._tied_head_packed = linear_ops.prepack(embedding)  # the embedding itself stays
        self.model.build_decode_stack()
        head = self._tied_head_packed
        if isinstance(self.lm_head, Linear) and self.lm_head.bias is None:
            head = self.lm_head.packed
        if self.group is None and head is not None:
            self._greedy_head = greedy_head.greedy_head(head)
            self.greedy_token_rows = self._greedy_head.max_rows if self._greedy_head is not None else 0

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``compute_logits(hidden)`` (int64), or None where it declines (then compute the
        logits): for plain greedy steps of up to ``greedy_token_rows`` rows."""
        return None if self._greedy_head is None else self._greedy_head(hidden)
