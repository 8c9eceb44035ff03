"""Attention backends behind one interface, chosen by name and imported lazily."""

from __future__ import annotations

import importlib

_BACKENDS = {
    "torch": ("quire.core.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("quire.core.attention.triton_backend", "TritonAttentionBackend"),
}


def get_attention_backend(name: str):
    """Return the backend class registered under ``name``."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)
