"""Writing new keys and values into the paged KV cache.

Cache layout (one tensor per layer; the one place it is defined)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
               |  |           |
               |  |           +-- token offset inside the block
               |  +-- physical block id (block 0 is the engine's reserved null block)
               +-- 0 = keys, 1 = values

A token's *slot* is ``block_id * block_size + offset``; ``kv_cache[0]`` and ``kv_cache[1]`` are
contiguous, so a slot indexes them directly once flattened to ``[num_slots, num_kv_heads, head_dim]``.
"""

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, H, D]`` at ``slot_mapping [T]`` (int64) of the caches ``[N, B, H, D]``."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
