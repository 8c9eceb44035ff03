"""The PyTorch attention backend: the CPU path and the reference for the others."""

from __future__ import annotations

import torch

from quire.core.attention.backend import AttentionBackend, AttentionCapabilities
from quire.core.attention.metadata import AttentionMetadata
from quire.kernels.attention import AttentionPlan, plan_paged_attention, run_paged_attention
from quire.kernels.kv_cache import write_kv_cache


class TorchAttentionBackend(AttentionBackend):
    """Writes new keys/values into the paged cache, then runs paged attention over it.

    Decodes go through Quire's C++ kernel (``quire.kernels.cpu_extension``) when it is available for the
    dtype (float32, bfloat16), reading the cache in place; prompts and the fallback use PyTorch's
    ``scaled_dot_product_attention``. With the C++ kernel the backend offers the C++ decoder stack
    (``capabilities.cpu_decode_stack``), whose attention is that same kernel.
    """

    name = "torch"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        self._decode_kernel = None
        if device == "cpu" and dtype in ("float32", "bfloat16"):
            from quire.kernels import cpu_extension

            self._decode_kernel = cpu_extension.load()
        self.capabilities = AttentionCapabilities(cpu_decode_stack=self._decode_kernel is not None)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Once per step: plan the batch's attention (grouping, masks, block lists) for every layer."""
        metadata.plan = plan_paged_attention(metadata.block_tables, metadata.seq_lens,
                                             metadata.query_start_loc, metadata.block_size, self._decode_kernel)

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
        return run_paged_attention(query, key_cache, value_cache, metadata.plan, scale)

    def decode_stack_inputs(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused decode's tables and lengths when it covers every row of the step (no prompt tokens)."""
        plan: AttentionPlan = metadata.plan
        fused = plan.fused_decode
        if fused is None or fused.token_rows is not None or plan.prefills:
            return None
        return fused.block_tables, fused.seq_lens
