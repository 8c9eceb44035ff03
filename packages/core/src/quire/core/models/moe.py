"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): Llama's decoder with a routed sparse MoE block as the MLP.

Module names follow transformers' in-memory layout: ``mlp.gate`` is the router and ``mlp.experts.gate_up_proj``
/ ``mlp.experts.down_proj`` hold every expert's weights stacked (the registry entry's weight mapping stacks the
checkpoint's per-expert tensors into them). The routing and expert matrix multiplies are
``quire.kernels.moe.fused_moe``.
"""

from __future__ import annotations

import torch
from torch import nn

from quire.core.attention.backend import AttentionBackend
from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.models.layers import Linear
from quire.core.models.llama import LlamaForCausalLM, LlamaMLP
from quire.kernels import moe


class StackedExperts(nn.Module):
    """Every expert's gated MLP weights, stacked: ``gate_up_proj`` ``[num_experts, 2 * intermediate, hidden]``
    (gate rows then up rows) and ``down_proj`` ``[num_experts, hidden, intermediate]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.packed: moe.PackedExperts | None = None

    def prepack(self) -> None:
        """Prepare each expert's weights for the device's fastest matrix multiply (a no-op if none)."""
        if self.gate_up_proj is not None and moe.can_prepack_experts(self.gate_up_proj):
            self.packed = moe.prepack_experts(self.gate_up_proj.data, self.down_proj.data)
            self.gate_up_proj = self.down_proj = None  # the packed forms hold what they need


class SparseMoeBlock(nn.Module):
    """The router (``gate``) picks ``num_experts_per_tok`` experts per token; their outputs, weighted by the
    router's probabilities, are summed."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts, False, dtype)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, dtype)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        return moe.fused_moe(x, self.gate(x), experts.gate_up_proj, experts.down_proj, self.top_k, self.renormalize,
                             experts.packed)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's causal LM with ``SparseMoeBlock`` as the MLP of every layer but ``config.dense_mlp_layers``. Runs
    in one process: the experts are not split over tensor-parallel ranks."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        if config.num_experts < 1:
            raise ConfigError(f"{config.architecture} needs num_experts of at least 1")
        dtype = getattr(torch, config.dtype)

        def mlp(layer_index: int) -> nn.Module:
            if layer_index in config.dense_mlp_layers:
                return LlamaMLP(config, dtype)
            return SparseMoeBlock(config, dtype)

        super().__init__(config, backend, mlp=mlp)

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, StackedExperts):
                module.prepack()
        super().prepack()  # the linear layers (router included); the C++ decode stack declines MoE layers
