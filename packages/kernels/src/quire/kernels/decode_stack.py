"""Every decoder layer of a decode step in one C++ call, on the CPU: for bfloat16 models on the ``kernel``
path, and for models whose linear layers are quantized (GGUF blocks or ``--quantization int8``).

A step in which every request brings one token (each decode step of a batch without prompts) runs the
same kernels the Python modules call, in the same order, so its results are bit-identical to theirs;
what it saves is the Python between them (about 6 ms of a 0.5B model's 49 ms batch-1 token on two AVX2
cores, about 4 ms of SmolLM2-135M's 11 ms at Q4_1). The C++ side is ``csrc/decode_stack.cpp``.
"""

from __future__ import annotations

import torch

from quire.kernels import cpu_extension
from quire.kernels.linear import KernelLinear

# Per layer, in the order the C++ constructor takes them (None where a checkpoint has no such tensor).
LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
                 "gate_up", "down")
LINEAR_LAYERS = ("qkv", "o_proj", "gate_up", "down")


def kernel_weight(packed) -> torch.Tensor | None:
    """The plain bfloat16 weight behind a linear layer prepacked for the ``kernel`` path, else None."""
    return packed.weight if isinstance(packed, KernelLinear) else None


def build(layers: list[dict], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
          eps: float, scale: float):
    """A ``DecodeStack`` (``forward(hidden, kv_caches, block_tables, seq_lens, slot_mapping, cos, sin)``
    returns the final norm's output), or None when the C++ kernels are unavailable.

    Each layer maps ``LAYER_TENSORS`` to tensors (or None); a linear layer (``LINEAR_LAYERS``) is either a
    bfloat16 weight (``kernel_weight``) or a list of ``quire.kernels.quant.QuantizedWeight`` row segments."""
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
