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
    """Store ``key``/``value`` ``[T, H, D]`` at ``slot_mapping [T]`` (int64) of the caches ``[N, B, H, D]``
    (a Triton kernel on CUDA devices, where a negative slot marks a padding row to skip)."""
    if key.is_cuda:
        from quire.kernels.triton_ops import elementwise

        elementwise.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping)


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``write_kv_cache`` in PyTorch ops (every slot valid)."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
