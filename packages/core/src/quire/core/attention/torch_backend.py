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
    ``scaled_dot_product_attention`` (a whole prompt without a cached prefix: the C++ ``prefill_attention``
    on its own keys, in bfloat16 on CPUs with AMX, or AVX2 without AVX-512 BF16). With the C++ kernel the
    backend offers the C++ decoder stack (``capabilities.cpu_decode_stack``), whose attention is that same
    kernel. Windowed layers run a plan of their own (built by the first such layer of a step, per window), which
    decodes through PyTorch and reads only the blocks inside each query's window.
    """

    name = "torch"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        self._decode_kernel = None
        if device == "cpu" and dtype in ("float32", "bfloat16"):
            from quire.kernels import cpu_extension

            self._decode_kernel = cpu_extension.load()
        self.capabilities = AttentionCapabilities(cpu_decode_stack=self._decode_kernel is not None,
                                                  supports_sliding_window=True)

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
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key``/``value [T, Hk, D]``; ``kv_cache`` as in ``quire.kernels.kv_cache``."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        plan = metadata.plan if sliding_window is None else self._windowed_plan(metadata, sliding_window)
        return run_paged_attention(query, key_cache, value_cache, plan, scale, key, value)

    def _windowed_plan(self, metadata: AttentionMetadata, sliding_window: int) -> AttentionPlan:
        """The step's plan for layers with this window: the plain plan while no request is longer than the
        window (nothing to mask), else one built once per step."""
        plan: AttentionPlan = metadata.plan
        if max(metadata.seq_lens) <= sliding_window:
            return plan
        windowed = plan.windowed_plans.get(sliding_window)
        if windowed is None:
            windowed = plan_paged_attention(metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                                            metadata.block_size, sliding_window=sliding_window)
            plan.windowed_plans[sliding_window] = windowed
        return windowed

    def decode_stack_inputs(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused decode's tables and lengths when it covers every row of the step (no prompt tokens)."""
        plan: AttentionPlan = metadata.plan
        fused = plan.fused_decode
        if fused is None or fused.token_rows is not None or plan.prefills:
            return None
        return fused.block_tables, fused.seq_lens
