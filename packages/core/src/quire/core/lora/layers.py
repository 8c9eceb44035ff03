"""LoRA around a model's projections: a ``LoRALinear`` adds, to its base layer's output, the low-rank
product of whichever adapter each token's request runs with.

Every ``LoRALinear`` of a model holds ``max_loras`` slots of stacked adapter weights and reads the step's
``LoRABatch``, which the ``LoRAManager`` fills once per step: per active slot, the rows of the step's
tokens that use it. A fused projection (q/k/v, gate/up) holds its parts' factors side by side: ``A`` of
shape ``[sum of the parts' ranks, in]`` and ``B`` of shape ``[out, sum of ranks]``, each part's ``B``
filling its own output rows and rank columns, so one product covers every part::

    B = [ B_q  0    0   ]      A = [ A_q ]
        [ 0    B_k  0   ]          [ A_k ]
        [ 0    0    B_v ]          [ A_v ]

The scaling (``lora_alpha / r``) is folded into ``B`` when the adapter is written into its slot.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRABatch:
    """One step's adapters: ``groups`` lists ``(slot, rows)``, ``rows`` the step's token rows that run with
    the adapter in ``slot`` (None: every row)."""

    def __init__(self):
        self.groups: list[tuple[int, torch.Tensor | None]] = []


class LoRALinear(nn.Module):
    """``base(x)`` plus, for each group of rows, ``(x A^T) B^T`` of the group's slot (held transposed and
    contiguous, ``A^T [in, rank]`` and ``B^T [rank, out]``, so each product is one plain matrix multiply)."""

    def __init__(self, base: nn.Module, in_features: int, part_rows: list[int], max_loras: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.part_rows = list(part_rows)
        self.slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras  # None: no change
        self.batch = batch
        self.dtype, self.device = dtype, device

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Write an adapter into ``slot``: ``parts[i] = (A [r, in], B [rows_i, r])`` for the parts it targets."""
        if not parts:
            self.slots[slot] = None
            return
        total_rank = sum(a.shape[0] for a, _ in parts.values())
        a_t = torch.zeros(self.in_features, total_rank, dtype=self.dtype, device=self.device)
        b_t = torch.zeros(total_rank, sum(self.part_rows), dtype=self.dtype, device=self.device)
        column, row_starts = 0, [sum(self.part_rows[:i]) for i in range(len(self.part_rows))]
        for index in sorted(parts):
            a, b = parts[index]
            rank, start = a.shape[0], row_starts[index]
            a_t[:, column:column + rank] = a.T
            b_t[column:column + rank, start:start + self.part_rows[index]] = (b.float() * scaling).T
            column += rank
        self.slots[slot] = (a_t, b_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.batch.groups:
            factors = self.slots[slot]
            if factors is None:
                continue
            a_t, b_t = factors
            if rows is None:
                out.addmm_(x @ a_t, b_t)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
        return out
