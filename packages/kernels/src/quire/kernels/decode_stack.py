"""Every decoder layer of a decode step in one C++ call, on the CPU: for bfloat16 models (on the ``kernel``
path and on the ``onednn`` one, whose packed weights the stack hands to ``onednn_gemv`` or oneDNN's op on
the rule ``OneDNNLinear`` follows), and for models
whose linear layers are quantized (GGUF blocks or ``--quantization int8``).

A step in which every request brings one token (each decode step of a batch without prompts) runs the
same kernels the Python modules call, in the same order, so its results are bit-identical to theirs;
what it saves is the Python between them (about 6 ms of a 0.5B model's 49 ms batch-1 token on two AVX2
cores, about 4 ms of SmolLM2-135M's 11 ms at Q4_1, about 4.5 ms of its 22 ms bfloat16 token through oneDNN on
two AMX cores). The C++ side is ``csrc/decode_stack.cpp``.
"""

from __future__ import annotations

import torch

from quire.kernels import cpu_extension
from quire.kernels.linear import KernelLinear, OneDNNLinear

# Per layer, in the order the C++ constructor takes them (None where a checkpoint has no such tensor).
LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
                 "gate_up", "down")
LINEAR_LAYERS = ("qkv", "o_proj", "gate_up", "down")


def kernel_weight(packed) -> torch.Tensor | None:
    """What the stack computes a prepacked bfloat16 linear layer with: the plain weight on the ``kernel`` path,
    oneDNN's packed one (an mkldnn tensor) on the ``onednn`` path; None for any other layer."""
    if isinstance(packed, KernelLinear):
        return packed.weight
    return packed.packed if isinstance(packed, OneDNNLinear) else None


def build(layers: list[dict], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
          eps: float, scale: float):
    """A ``DecodeStack`` (``forward(hidden, kv_caches, block_tables, seq_lens, slot_mapping, cos, sin)``
    returns the final norm's output), or None when the C++ kernels are unavailable.

    Each layer maps ``LAYER_TENSORS`` to tensors (or None); a linear layer (``LINEAR_LAYERS``) is either a
    bfloat16 weight (``kernel_weight``: plain, or packed by oneDNN) or a list of
    ``quire.kernels.quant.QuantizedWeight`` row segments."""
    kernels = cpu_extension.load()
    if kernels is None or not hasattr(kernels, "DecodeStack"):
        return None
    tensors, quantized = [], []
    for layer in layers:
        tensors.append([None if isinstance(layer[name], list) else layer[name] for name in LAYER_TENSORS])
        quantized.append([[(w.data, w.scale, w.qtype) for w in layer[name]] if isinstance(layer[name], list) else []
                          for name in LINEAR_LAYERS])
    if not any(segments for layer in quantized for segments in layer):
        quantized = []
    return kernels.DecodeStack(tensors, final_norm, num_heads, num_kv_heads, head_dim, eps, scale, quantized)
