"""The Triton attention backend: the GPU path (and, under Triton's interpreter, testable on CPUs)."""

from __future__ import annotations

import dataclasses

import torch

from quire.core.attention.backend import AttentionBackend, AttentionCapabilities
from quire.core.attention.metadata import AttentionMetadata


@dataclasses.dataclass
class TritonAttentionPlan:
    """One step's attention inputs as tensors on the model's device, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64; negative: a padding row that writes nothing
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_seq_len: int  # bounds seq_lens (a CUDA graph is captured with max_model_len)
    max_query_len: int
    is_decode_only: bool  # every request has one query, row i is request i


class TritonAttentionBackend(AttentionBackend):
    """Writes new keys/values into the paged cache and runs paged attention, both in Triton kernels.

    Pure decode steps use the decode kernel (query heads grouped by KV head, split contexts); steps with
    prompt chunks run the variable-length kernel over every request. Decode plans can be built over a
    CUDA graph's static buffers (``graph_decode_plan``). Windowed layers pass their ``sliding_window`` to
    both kernels, which read only the blocks inside each query's window.
    """

    name = "triton"
    capabilities = AttentionCapabilities(supports_cuda_graphs=True, supports_sliding_window=True)

    def __init__(self, dtype: str = "bfloat16", device: str = "cuda"):
        from quire.kernels.triton_ops import attention, elementwise  # imports triton

        self.device = torch.device(device)
        self._attention = attention
        self._elementwise = elementwise

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Once per step: copy the step's indices to the device."""
        device = self.device
        metadata.plan = TritonAttentionPlan(
            slot_mapping=metadata.slot_mapping.to(device, non_blocking=True),
            block_tables=metadata.block_tables.to(device=device, dtype=torch.int32, non_blocking=True),
            seq_lens=torch.tensor(metadata.seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            query_start_loc=torch.tensor(metadata.query_start_loc, dtype=torch.int32).to(device, non_blocking=True),
            max_seq_len=max(metadata.seq_lens),
            max_query_len=metadata.max_query_len,
            is_decode_only=metadata.max_query_len == 1,
        )

    def graph_decode_plan(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, max_seq_len: int) -> TritonAttentionPlan:
        """A pure decode plan over tensors the caller owns (the static buffers of a CUDA graph)."""
        return TritonAttentionPlan(slot_mapping, block_tables, seq_lens, query_start_loc, max_seq_len,
                                   max_query_len=1, is_decode_only=True)

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
        plan: TritonAttentionPlan = metadata.plan
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._elementwise.write_kv_cache(key, value, key_cache, value_cache, plan.slot_mapping)
        if plan.is_decode_only:
            return self._attention.paged_decode(query, key_cache, value_cache, plan.block_tables, plan.seq_lens,
                                                scale, plan.max_seq_len, sliding_window=sliding_window)
        return self._attention.paged_prefill(query, key_cache, value_cache, plan.block_tables, plan.seq_lens,
                                             plan.query_start_loc, scale, plan.max_query_len,
                                             sliding_window=sliding_window)
