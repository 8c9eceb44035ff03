"""Per-step attention inputs, built by the model runner and passed down ``model.forward`` explicitly."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quire.core.attention.triton_backend import TritonAttentionPlan
    from quire.kernels.attention import AttentionPlan as TorchAttentionPlan

    # One step's backend-specific work, shared by every layer; only the backend that built it reads it.
    BackendPlan = TorchAttentionPlan | TritonAttentionPlan


@dataclasses.dataclass
class AttentionMetadata:
    """Where each token's keys and values go, and what each request attends to.

    The batch is flat: request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]`` and
    has ``seq_lens[i]`` tokens in the cache once this step's keys are written.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_requests, max_blocks] int32/int64
    query_start_loc: list[int]  # num_requests + 1 offsets
    seq_lens: list[int]  # num_requests
    max_query_len: int
    block_size: int = 16
    # Set by the backend's ``prepare`` (or ``graph_decode_plan``); None until then.
    plan: BackendPlan | None = None
