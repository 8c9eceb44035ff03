"""Every decoder layer of a decode step in one C++ call, for bfloat16 models on the CPU's ``kernel`` path.

A step in which every request brings one token (each decode step of a batch without prompts) runs the
same kernels the Python modules call, in the same order, so its results are bit-identical to theirs;
what it saves is the Python between them (about 6 ms of a 0.5B model's 49 ms batch-1 token on two AVX2
cores). The C++ side is ``csrc/decode_stack.cpp``.
"""

from __future__ import annotations

import torch

from quire.kernels import cpu_extension
from quire.kernels.linear import KernelLinear

# Per layer, in the order the C++ constructor takes them (None where a checkpoint has no such tensor).
LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
                 "gate_up", "down")


def kernel_weight(packed) -> torch.Tensor | None:
    """The plain bfloat16 weight behind a linear layer prepacked for the ``kernel`` path, else None."""
    return packed.weight if isinstance(packed, KernelLinear) else None


def build(layers: list[dict[str, torch.Tensor | None]], final_norm: torch.Tensor, num_heads: int,
          num_kv_heads: int, head_dim: int, eps: float, scale: float):
    """A ``DecodeStack`` (``forward(hidden, kv_caches, block_tables, seq_lens, slot_mapping, cos, sin)``
    returns the final norm's output), or None when the C++ kernels are unavailable."""
    kernels = cpu_extension.load()
    if kernels is None or not hasattr(kernels, "DecodeStack"):
        return None
    tensors = [[layer[name] for name in LAYER_TENSORS] for layer in layers]
    return kernels.DecodeStack(tensors, final_norm, num_heads, num_kv_heads, head_dim, eps, scale)
