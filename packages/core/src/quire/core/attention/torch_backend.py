"""The PyTorch attention backend: the CPU path and the reference for the others."""

from __future__ import annotations

import torch

from quire.core.attention.metadata import AttentionMetadata
from quire.kernels.attention import paged_attention
from quire.kernels.kv_cache import write_kv_cache


class TorchAttentionBackend:
    """Writes new keys/values into the paged cache, then runs paged attention over it."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key``/``value [T, Hk, D]``; ``kv_cache`` as in ``quire.kernels.kv_cache``."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_attention(
            query, key_cache, value_cache, metadata.block_tables,
            metadata.seq_lens, metadata.query_start_loc, scale,
        )
