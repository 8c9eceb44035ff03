"""Loading a GGUF file's tensors into a model, keeping quantized weights quantized.

Weights of the types ``quire.kernels.quant`` computes on (``KEPT_QUANTIZED``) stay in their GGUF blocks:
the linear layer (or the token embedding) they belong to drops its float parameter and holds
``QuantizedWeight`` row segments instead (a fused q/k/v may mix types, as ``Q4_K_M`` files do). Float
tensors, and quantized types without a kernel (dequantized by the ``gguf`` package, logged when the file is
opened), go through the same ``load_weights`` as safetensors checkpoints.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.models.gguf import KEPT_QUANTIZED, GGUFCheckpoint, GGUFTensor
from quire.core.models.registry import WeightMapping
from quire.core.models.weights import load_weights
from quire.kernels import quant

logger = logging.getLogger(__name__)


def load_gguf_weights(model: nn.Module, checkpoint: GGUFCheckpoint, mapping: WeightMapping,
                      config: ModelConfig) -> None:
    """Fill ``model`` from ``checkpoint``: quantized segments into their modules, floats into parameters."""
    modules = dict(model.named_modules())
    segments: dict[str, list[tuple[int, quant.QuantizedWeight]]] = defaultdict(list)
    floats: list[tuple[str, torch.Tensor]] = []
    for tensor in checkpoint.hf_tensors():
        if mapping.is_skipped(tensor.name, config):
            continue
        if tensor.qtype in KEPT_QUANTIZED:
            target, offset = mapping.target(tensor.name, config)
            module_name = target.rsplit(".", 1)[0]
            if not hasattr(modules.get(module_name), "set_quantized"):
                raise ConfigError(f"GGUF tensor {tensor.gguf_name!r} ({tensor.qtype}) has no quantized place in "
                                  f"{type(model).__name__}")
            segments[module_name].append((offset, _quantized(tensor)))
        else:
            floats.append((tensor.name, _float_tensor(tensor)))
    for module_name, parts in segments.items():
        module = modules[module_name]
        rows = sum(weight.out_features for _, weight in parts)
        if rows != module.weight.shape[0] or any(w.in_features != module.weight.shape[1] for _, w in parts):
            raise ConfigError(f"GGUF weights for {module_name} have shape ({rows}, {parts[0][1].in_features}), "
                              f"which does not fit {tuple(module.weight.shape)}")
        module.set_quantized(_merge([weight for _, weight in sorted(parts, key=lambda part: part[0])]))
    load_weights(model, floats, mapping, config)


def iterate_gguf_float_weights(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor dequantized to float32 under its Hugging Face name (for tests and conversions)."""
    for tensor in checkpoint.hf_tensors():
        if tensor.qtype in KEPT_QUANTIZED:
            yield tensor.name, quant.dequantize_reference(_quantized(tensor))
        else:
            yield tensor.name, _float_tensor(tensor).float()


def _row_order(tensor: GGUFTensor) -> np.ndarray | None:
    """Row indices that undo llama.cpp's rotary reordering of q/k rows (None: rows stay as they are)."""
    if not tensor.permute_heads:
        return None
    rows, heads = tensor.shape[0], tensor.permute_heads
    # llama.cpp stores row (h, i, j) of (heads, 2, rows/heads/2) at (h, j, i); read back the other way.
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _quantized(tensor: GGUFTensor) -> quant.QuantizedWeight:
    rows, columns = tensor.shape
    raw = np.asarray(tensor.data).reshape(rows, -1)
    order = _row_order(tensor)
    raw = raw[order] if order is not None else np.array(raw)  # a copy: the file's pages are not kept mapped
    return quant.QuantizedWeight.from_gguf_bytes(tensor.qtype, torch.from_numpy(raw), rows, columns)


def _float_tensor(tensor: GGUFTensor) -> torch.Tensor:
    if tensor.qtype in ("F32", "F16"):
        array = np.asarray(tensor.data)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        array = dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.qtype])
    array = array.reshape(tensor.shape)
    order = _row_order(tensor)
    array = array[order] if order is not None else np.array(array)
    return torch.from_numpy(array)  # F32, F16 as stored; dequantized types come out float32


def _merge(weights: list[quant.QuantizedWeight]) -> list[quant.QuantizedWeight]:
    """Adjacent row segments of the same type joined into one (one kernel call instead of several)."""
    merged = [weights[0]]
    for weight in weights[1:]:
        last = merged[-1]
        if weight.qtype == last.qtype:
            merged[-1] = quant.QuantizedWeight.concat_rows([last, weight])
        else:
            merged.append(weight)
    return merged
