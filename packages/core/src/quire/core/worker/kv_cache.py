"""Sizing the KV cache from a byte budget and allocating it (layout: see ``quire.kernels.kv_cache``)."""

from __future__ import annotations

import torch

from quire.core.config import CacheConfig, ModelConfig
from quire.core.errors import ConfigError

DEFAULT_KV_CACHE_MEMORY = 4 * 1024**3


def blocks_per_sequence(model: ModelConfig, block_size: int, max_num_batched_tokens: int | None = None) -> int:
    """The most blocks one request holds: its whole context, or, where every layer attends within a window
    (``ModelConfig.kv_cache_sliding_window``, whose older blocks the KV-cache manager releases), the window
    before a step's first new token and that step's tokens (at most ``max_num_batched_tokens``), partly
    filled blocks at both ends included."""
    whole = -(-model.max_model_len // block_size)
    window = model.kv_cache_sliding_window
    if window is None or max_num_batched_tokens is None:
        return whole
    span = window - 1 + min(max_num_batched_tokens, model.max_model_len)
    return min(whole, (span + 2 * block_size - 2) // block_size)


def num_kv_blocks(model: ModelConfig, cache: CacheConfig, max_num_seqs: int,
                  max_num_batched_tokens: int | None = None) -> int:
    """How many blocks (including the reserved null block) the budget buys.

    Without an explicit ``kv_cache_memory`` the budget is what ``max_num_seqs`` full-length sequences
    need (``blocks_per_sequence``: less with sliding windows), capped at 4 GiB.
    """
    bytes_per_block = model.kv_bytes_per_token * cache.block_size
    blocks_per_seq = blocks_per_sequence(model, cache.block_size, max_num_batched_tokens)
    budget = cache.kv_cache_memory
    if budget is None:
        budget = min(DEFAULT_KV_CACHE_MEMORY, (max_num_seqs * blocks_per_seq + 1) * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < blocks_per_seq + 1:
        raise ConfigError(
            f"kv_cache_memory of {budget} bytes holds {num_blocks} blocks of {cache.block_size} tokens "
            f"({bytes_per_block} bytes each), but one sequence of max_model_len={model.max_model_len} "
            f"needs {blocks_per_seq} plus a reserved block: raise kv_cache_memory to at least "
            f"{(blocks_per_seq + 1) * bytes_per_block} or lower max_model_len"
        )
    return int(num_blocks)


def allocate_kv_caches(model: ModelConfig, num_blocks: int, block_size: int,
                       device: str = "cpu") -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

    NOTE: zeroed, not empty: masked-out slots still enter the attention product, and garbage NaNs
    there would poison it.
    """
    shape = (2, num_blocks, block_size, model.num_key_value_heads, model.head_dim)
    dtype = getattr(torch, model.dtype)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_hidden_layers)]
