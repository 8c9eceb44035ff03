"""Routed experts (mixture of experts): top-k routing and the experts' gated MLPs over the tokens routed to them.

Expert weights are stacked, one slice per expert, in the layout transformers keeps them in memory::

    w_gate_up  [num_experts, 2 * intermediate, hidden]   rows: gate then up (SiLU(gate) * up)
    w_down     [num_experts, hidden, intermediate]

``fused_moe`` routes and runs the experts; ``moe_reference`` is the obviously-correct per-expert loop over
tokens that it is tested against. The arithmetic follows transformers' Mixtral and Qwen3-MoE: softmax in
float32, top-k of the probabilities, optionally divided by their sum; each expert's output in the input
dtype, multiplied by its float32 weight and summed over the top-k in float32, rounded once at the end.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from quire.kernels import linear as linear_ops
from quire.kernels.activation import silu_and_mul, silu_and_mul_reference


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """Every expert's two weights prepared once for the device's fastest matrix multiply (``linear.prepack``)."""

    gate_up: tuple[linear_ops.PackedLinear, ...]
    down: tuple[linear_ops.PackedLinear, ...]


def can_prepack_experts(w_gate_up: torch.Tensor) -> bool:
    return linear_ops.can_prepack(w_gate_up)


def prepack_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> PackedExperts:
    """One prepacked linear per expert and projection (only when ``can_prepack_experts``)."""
    return PackedExperts(gate_up=tuple(linear_ops.prepack(w) for w in w_gate_up),
                         down=tuple(linear_ops.prepack(w) for w in w_down))


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, both ``[num_tokens, top_k]``: the ``top_k`` largest of the softmax (in float32)
    of ``router_logits`` (``[num_tokens, num_experts]``), divided by their sum if ``renormalize``. The weights
    are float32."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor | None,
              w_down: torch.Tensor | None, top_k: int, renormalize: bool,
              packed: PackedExperts | None = None) -> torch.Tensor:
    """``sum_k weight_k * expert_k(hidden)`` over each token's ``top_k`` experts (``select_experts``), where
    ``expert(x) = down(silu(gate(x)) * up(x))``; ``hidden`` is ``[num_tokens, hidden]``. With ``packed`` the
    stacked weights may be None."""
    weights, expert_ids = select_experts(router_logits, top_k, renormalize)
    return routed_experts(hidden, weights, expert_ids, w_gate_up, w_down, packed)


def routed_experts(hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                   w_gate_up: torch.Tensor | None, w_down: torch.Tensor | None,
                   packed: PackedExperts | None = None) -> torch.Tensor:
    """The experts' part of ``fused_moe`` for given routing (``weights``, ``expert_ids``: ``[num_tokens, top_k]``).

    The ``num_tokens * top_k`` (token, expert) pairs are sorted by expert, so each active expert runs one
    matrix multiply per projection over all its rows; the weighted outputs are added back per token.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = len(packed.gate_up) if packed is not None else w_gate_up.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    rows_per_expert = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_ids = order // top_k
    gathered = hidden.index_select(0, token_ids)
    expert_out = torch.empty_like(gathered)
    start = 0
    for expert, num_rows in enumerate(rows_per_expert):
        if num_rows == 0:
            continue
        rows = slice(start, start + num_rows)
        gate_up = linear_ops.linear(gathered[rows], None if packed else w_gate_up[expert], None,
                                    packed.gate_up[expert] if packed else None)
        expert_out[rows] = linear_ops.linear(silu_and_mul(gate_up), None if packed else w_down[expert], None,
                                             packed.down[expert] if packed else None)
        start += num_rows
    weighted = expert_out.float() * weights.reshape(-1).index_select(0, order).float().unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, token_ids, weighted).to(hidden.dtype)


def moe_reference(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """``fused_moe`` one token and one of its experts at a time, in PyTorch ops."""
    weights, expert_ids = select_experts(router_logits, top_k, renormalize)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for token in range(hidden.shape[0]):
        for k in range(top_k):
            expert = int(expert_ids[token, k])
            x = hidden[token:token + 1]
            y = F.linear(silu_and_mul_reference(F.linear(x, w_gate_up[expert])), w_down[expert])
            out[token] += y[0].float() * weights[token, k]
    return out.to(hidden.dtype)
