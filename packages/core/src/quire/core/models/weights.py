"""Reading checkpoint tensors from ``*.safetensors`` files (single or sharded, memory-mapped) into a model."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.models.registry import WeightMapping


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in model folder {str(folder)!r}")
    return files


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint."""
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def iterate_weight_shards(folder: str | Path, model: nn.Module, mapping: WeightMapping, config: ModelConfig,
                          rank: int, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Like ``iterate_weights``, for rank ``rank`` of a model split ``world_size`` ways: a tensor whose
    parameter is split (``SHARD_DIM``) comes as this rank's slice only, read from the memory-mapped file
    without the rest. ``config`` is the rank's shard, whose sizes say how large each slice is."""
    from quire.core.distributed.group import shard_range
    from quire.core.models.parallel_layers import SHARD_DIM

    params = dict(model.named_parameters())
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                param = None if mapping.is_skipped(name, config) else params.get(mapping.target(name, config)[0])
                dim = getattr(param, SHARD_DIM, None)
                if dim is None:
                    yield name, handle.get_tensor(name)
                    continue
                view = handle.get_slice(name)
                local_size = (mapping.part_rows(name, config) if dim == 0 else None) or param.shape[dim]
                start, stop = shard_range(view.get_shape()[dim], local_size, rank, world_size)
                yield name, view[start:stop] if dim == 0 else view[:, start:stop]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], mapping: WeightMapping,
                 config: ModelConfig) -> None:
    """Copy checkpoint tensors into the model's (fused) parameters as ``mapping`` places them; raise
    ConfigError for a tensor with no place or the wrong shape, and if any parameter is left unset."""
    params = dict(model.named_parameters())
    filled: dict[str, list[tuple[int, int]]] = defaultdict(list)  # the row ranges written to each parameter
    for name, tensor in weights:
        if mapping.is_skipped(name, config):
            continue
        target, offset = mapping.target(name, config)
        if target not in params:
            raise ConfigError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param, shape = params[target].data, tuple(tensor.shape)
        if param.dim() > 2:  # stacked experts ``[num_experts, rows, columns]`` fill as ``[num_experts * rows, …]``
            param = param.flatten(0, -2)
            tensor = tensor.flatten(0, -2) if tensor.dim() > 2 else tensor
        rows = tensor.shape[0]
        if offset + rows > param.shape[0] or tensor.shape[1:] != param.shape[1:]:
            raise ConfigError(f"checkpoint tensor {name!r} has shape {shape}, "
                              f"which does not fit {target} {tuple(params[target].shape)}")
        param[offset:offset + rows].copy_(tensor)
        filled[target].append((offset, offset + rows))
    unfilled = mapping.expected_shards(params, config) - {(target, start) for target, ranges in filled.items()
                                                          for start, _ in ranges}
    # a stacked tensor (all experts at once) fills the shards inside its rows too
    missing = sorted((target, offset) for target, offset in unfilled
                     if not any(start <= offset < stop for start, stop in filled[target]))
    if missing:
        raise ConfigError("checkpoint is missing weights for: "
                          + ", ".join(f"{name}@{offset}" for name, offset in missing[:8]))
