"""Per-step attention inputs, built by the model runner and passed down ``model.forward`` explicitly."""

from __future__ import annotations

import dataclasses

import torch


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
    # Backend-specific work done once per step for all layers (set by the backend's ``prepare``).
    plan: object = None
