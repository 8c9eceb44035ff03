"""The worker's LoRA adapters: the model's projections wrapped in ``LoRALinear``, which adapter sits in
which of their ``max_loras`` slots (least recently used evicted), adapters read from disk once and kept in
host memory (``max_cpu_loras``), and each step's rows per adapter."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quire.core.config import LoRAConfig, ModelConfig
from quire.core.lora.adapter_config import ADAPTER_WEIGHTS, TARGETS, read_adapter_config
from quire.core.lora.layers import LoRABatch, LoRALinear
from quire.core.lora.request import LoRARequest

# (layer index, module name) -> {part index: (A [r, in], B [rows, r])}
AdapterWeights = dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


class LoRAManager:
    """Applies the adapters of each step's requests to a Llama-shaped model (built without tensor
    parallelism): ``prepare_step`` before every forward pass."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, config: LoRAConfig, device: torch.device):
        self.model_config = model_config
        self.config = config
        self.batch = LoRABatch()
        self.device = device
        self.model = model.model
        # the C++ decoder stack computes the plain projections: it runs only steps without adapters
        self._decode_stack, self.model.decode_stack = self.model.decode_stack, None
        self.layers = _wrap_projections(model, model_config, config, self.batch, device)
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # least recent first
        self._host: collections.OrderedDict[int, tuple[LoRARequest, AdapterWeights, float]] = (
            collections.OrderedDict())

    def prepare_step(self, token_lora_ids: np.ndarray, adapters: dict[int, LoRARequest]) -> None:
        """``token_lora_ids``: the adapter id of each token row of the step (0: the base model)."""
        ids = [lora_id for lora_id in np.unique(token_lora_ids).tolist() if lora_id]
        groups = []
        for lora_id in ids:
            slot = self._activate(adapters[lora_id], keep=ids)
            mask = token_lora_ids == lora_id
            rows = None if mask.all() else torch.from_numpy(np.flatnonzero(mask)).to(self.device)
            groups.append((slot, rows))
        self.batch.groups = groups
        self.model.decode_stack = None if groups else self._decode_stack

    def _activate(self, adapter: LoRARequest, keep: list[int]) -> int:
        """The slot holding ``adapter``, writing it into a free or least recently used one if needed."""
        lora_id = adapter.lora_int_id
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return self._slot_of[lora_id]
        used = set(self._slot_of.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self._slot_of if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.config.max_loras} adapters in one step")
            slot = self._slot_of.pop(victim)
        weights, scaling = self._load(adapter)
        for key, layer in self.layers.items():
            layer.set_slot(slot, weights.get(key, {}), scaling)
        self._slot_of[lora_id] = slot
        return slot

    def _load(self, adapter: LoRARequest) -> tuple[AdapterWeights, float]:
        cached = self._host.get(adapter.lora_int_id)
        if cached is not None and cached[0] == adapter:
            self._host.move_to_end(adapter.lora_int_id)
            return cached[1], cached[2]
        weights, scaling = load_adapter(adapter.lora_path, self.config.max_lora_rank, self.model_config)
        self._host[adapter.lora_int_id] = (adapter, weights, scaling)
        while len(self._host) > (self.config.max_cpu_loras or self.config.max_loras):
            self._host.popitem(last=False)
        return weights, scaling


def load_adapter(path: str, max_lora_rank: int, model_config: ModelConfig) -> tuple[AdapterWeights, float]:
    """An adapter folder's factors per wrapped projection, and its scaling (checked as the front end did)."""
    from safetensors.torch import load_file

    adapter = read_adapter_config(path, max_lora_rank, model_config)
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    factors: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for layer, _, proj, which, name in adapter.tensors:
        module, part = TARGETS[proj]
        factors.setdefault((layer, module, part), {})[which] = tensors[name]
    weights: AdapterWeights = {}
    for (layer, module, part), pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_A or lora_B alone")
        weights.setdefault((layer, module), {})[part] = (pair["A"], pair["B"])
    return weights, adapter.scaling


def _wrap_projections(model: nn.Module, model_config: ModelConfig, config: LoRAConfig, batch: LoRABatch,
                      device: torch.device) -> dict[tuple[int, str], LoRALinear]:
    """Replace each decoder layer's four projections with ``LoRALinear``."""
    dtype = getattr(torch, model_config.dtype)
    q_size = model_config.num_attention_heads * model_config.head_dim
    kv_size = model_config.num_key_value_heads * model_config.head_dim
    hidden, intermediate = model_config.hidden_size, model_config.intermediate_size
    shapes = {"qkv_proj": (hidden, [q_size, kv_size, kv_size]), "o_proj": (q_size, [hidden]),
              "gate_up_proj": (hidden, [intermediate, intermediate]), "down_proj": (intermediate, [hidden])}
    layers = {}
    for index, decoder_layer in enumerate(model.model.layers):
        for owner in (decoder_layer.self_attn, decoder_layer.mlp):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                if hasattr(owner, name):
                    in_features, part_rows = shapes[name]
                    wrapped = LoRALinear(getattr(owner, name), in_features, part_rows, config.max_loras,
                                         batch, dtype, device)
                    setattr(owner, name, wrapped)
                    layers[index, name] = wrapped
        decoder_layer.mlp.chunk_rows = None  # LoRA rows index the whole step
    return layers
