"""A PEFT LoRA folder read without torch: its settings checked against what Quire applies, and the
projections its tensors target (read from the safetensors header).

Quire applies LoRA to the attention and MLP projections of Llama-shaped models (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) with ``lora_alpha / r`` scaling, or
``lora_alpha / sqrt(r)`` with ``use_rslora``. Anything else an adapter asks for is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from quire.core.errors import ValidationError

if TYPE_CHECKING:
    from quire.core.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's projection name -> (Quire's module, which part of it): q/k/v are one fused qkv_proj, gate/up one
# gate_up_proj, their parts stacked along the output rows in this order.
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<prefix>.*\.layers\.(?P<layer>\d+)\.[a-z_]+)\."
                          r"(?P<proj>[a-z_]+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
# Settings that change what the adapter computes: Quire runs only adapters that leave them unset or empty.
_UNSUPPORTED_SETTINGS = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                         "layer_replication", "megatron_config", "trainable_token_indices", "use_qalora",
                         "lora_bias")


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What an adapter folder holds: its rank, the factor its product is scaled by, and its tensors as
    ``(layer index, module prefix, projection name, "A" or "B", tensor name)``."""

    path: str
    rank: int
    scaling: float
    tensors: tuple[tuple[int, str, str, str, str], ...]


def projection_shape(model: ModelConfig, proj: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of a Llama-shaped model's projection, by PEFT's name for it."""
    q_size, kv_size = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    hidden, intermediate = model.hidden_size, model.intermediate_size
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
            "o_proj": (hidden, q_size), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
            "down_proj": (hidden, intermediate)}[proj]


def read_adapter_config(path: str, max_lora_rank: int, model: ModelConfig,
                        param: str = "lora_request") -> AdapterConfig:
    """Check the folder at ``path`` against the base ``model``; ValidationError (naming ``param`` and the
    setting or tensor) for anything Quire cannot apply exactly."""
    folder = Path(path)
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise ValidationError(f"LoRA adapter {path!r}: no {ADAPTER_CONFIG}", param=param)
    if not weights_file.is_file():
        raise ValidationError(f"LoRA adapter {path!r}: no {ADAPTER_WEIGHTS} (Quire reads safetensors only)",
                              param=param)
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValidationError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} is not readable JSON: {error}",
                              param=param) from None
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValidationError(f"LoRA adapter {path!r}: peft_type {settings['peft_type']!r} is not supported "
                              "(only LORA)", param=param)
    for key in _UNSUPPORTED_SETTINGS:
        if settings.get(key):
            raise ValidationError(f"LoRA adapter {path!r}: {key}={settings[key]!r} is not supported", param=param)
    if settings.get("bias", "none") != "none":
        raise ValidationError(f"LoRA adapter {path!r}: bias={settings['bias']!r} is not supported (only none)",
                              param=param)
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValidationError(f"LoRA adapter {path!r}: r must be a positive integer and lora_alpha a number",
                              param=param)
    if rank > max_lora_rank:
        raise ValidationError(f"LoRA adapter {path!r}: rank {rank} is above max_lora_rank={max_lora_rank}",
                              param=param)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _tensors(weights_file, path, param, rank, model)
    return AdapterConfig(str(folder), rank, float(scaling), tensors)


def _tensors(weights_file: Path, path: str, param: str, rank: int,
             model: ModelConfig) -> tuple[tuple[int, str, str, str, str], ...]:
    tensors = []
    for name, shape in _safetensors_header(weights_file, path, param).items():
        match = _TENSOR_NAME.match(name)
        if match is None or match["proj"] not in TARGETS:
            raise ValidationError(f"LoRA adapter {path!r}: tensor {name!r} targets a module Quire does not "
                                  f"apply LoRA to (supported: {', '.join(TARGETS)})", param=param)
        layer, proj, which = int(match["layer"]), match["proj"], match["which"]
        out_features, in_features = projection_shape(model, proj)
        expected = [rank, in_features] if which == "A" else [out_features, rank]
        if layer >= model.num_hidden_layers or list(shape) != expected:
            raise ValidationError(f"LoRA adapter {path!r}: tensor {name!r} of shape {list(shape)} does not fit "
                                  f"the model (expected {expected} in one of {model.num_hidden_layers} layers): "
                                  "an adapter of another base model?", param=param)
        tensors.append((layer, match["prefix"], proj, which, name))
    if not tensors:
        raise ValidationError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} holds no LoRA tensors", param=param)
    return tuple(sorted(tensors))


def _safetensors_header(weights_file: Path, path: str, param: str) -> dict[str, list[int]]:
    """Tensor names and shapes from the file's header (8-byte little-endian length, then JSON)."""
    try:
        with weights_file.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError) as error:
        raise ValidationError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} is not a safetensors file ({error})",
                              param=param) from None
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}
