"""Layers split over a ``TensorParallelGroup``: each rank holds a slice of the weight and the layer's collective
makes the slices' results whole.

```
 column-split (qkv, gate/up):  each rank holds some output rows   x ─► [W_r] ─► its heads / MLP columns
 row-split (o, down):          each rank holds the matching inputs ─► [W_r] ─► partial sum ─► all-reduce (+ bias)
 vocabulary (embedding, head): each rank holds ceil(V / N) rows     lookup: masked, all-reduce
                                                                    logits: all-gather, cut back to V
```

``SHARD_DIM`` on a parameter tells the sharded weight loader which dimension of the checkpoint tensor to
slice; parameters without it are whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quire.core.distributed.group import TensorParallelGroup
from quire.core.models.layers import Embedding, Linear
from quire.kernels import linear as linear_ops

SHARD_DIM = "shard_dim"


def split_output_rows(linear: Linear) -> Linear:
    """Mark a layer built with this rank's share of output rows (its weight and bias are row slices)."""
    setattr(linear.weight, SHARD_DIM, 0)
    if linear.bias is not None:
        setattr(linear.bias, SHARD_DIM, 0)
    return linear


class RowParallelLinear(Linear):
    """Takes this rank's share of the input columns; the partial products are summed over the group, then the
    (whole) bias is added once."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, dtype: torch.dtype,
                 group: TensorParallelGroup):
        super().__init__(in_features_per_rank, out_features, bias, dtype)
        setattr(self.weight, SHARD_DIM, 1)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(linear_ops.linear(x, self.weight, None, self.packed))
        return out if self.bias is None else out + self.bias


def vocab_rows_per_rank(vocab_size: int, group: TensorParallelGroup) -> int:
    return -(-vocab_size // group.world_size)


class VocabParallelEmbedding(Embedding):
    """Rank ``r`` holds token rows ``[r * n, (r + 1) * n)``; ids outside them look up zeros, and the sum over
    the group is the whole lookup. Rows past the vocabulary (the last rank's padding) stay zero."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, group: TensorParallelGroup):
        num_rows = vocab_rows_per_rank(vocab_size, group)
        super().__init__(num_rows, hidden_size, dtype)
        self.weight.data.zero_()
        setattr(self.weight, SHARD_DIM, 0)
        self.first_id = group.rank * num_rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_id
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def parallel_lm_head(vocab_size: int, hidden_size: int, dtype: torch.dtype, group: TensorParallelGroup) -> Linear:
    """This rank's rows of the LM head, zero past the vocabulary (see ``gather_logits``)."""
    head = split_output_rows(Linear(hidden_size, vocab_rows_per_rank(vocab_size, group), False, dtype))
    head.weight.data.zero_()
    return head


def gather_logits(local_logits: torch.Tensor, vocab_size: int, group: TensorParallelGroup) -> torch.Tensor:
    """Every rank's slice of the vocabulary's logits, joined into ``[num_tokens, vocab_size]`` on every rank
    (each rank samples the same tokens from them, so the persistent batches stay equal)."""
    return group.all_gather(local_logits)[..., :vocab_size]
