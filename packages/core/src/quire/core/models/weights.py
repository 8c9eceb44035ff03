"""Reading checkpoint tensors from ``*.safetensors`` files (single or sharded, memory-mapped)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from quire.core.errors import ConfigError


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
