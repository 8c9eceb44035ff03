"""Attention backends behind one interface (``backend.AttentionBackend``), chosen by name and imported lazily."""

from __future__ import annotations

from quire.core.attention.backend import AttentionBackend, AttentionCapabilities
from quire.core.errors import ConfigError
from quire.core.lazy_registry import LazyRegistry

_BACKENDS = LazyRegistry("attention backend", AttentionBackend)


def register_attention_backend(name: str, module_name: str, class_name: str) -> None:
    """Make ``module_name.class_name`` available as ``name``; it is imported and checked on first lookup."""
    _BACKENDS.register(name, module_name, class_name)


def registered_attention_backends() -> list[str]:
    return _BACKENDS.names()


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name``, checked against the ``AttentionBackend`` contract."""
    backend = _BACKENDS.get(name)
    check_attention_backend(backend, name)
    return backend


def check_attention_backend(backend: object, name: str) -> None:
    """Raise ConfigError unless ``backend`` is a complete ``AttentionBackend`` that calls itself ``name``."""
    _BACKENDS.check(backend, name)
    if getattr(backend, "name", None) != name:
        raise ConfigError(f"attention backend registered as {name!r} calls itself {getattr(backend, 'name', None)!r}")


register_attention_backend("torch", "quire.core.attention.torch_backend", "TorchAttentionBackend")
register_attention_backend("triton", "quire.core.attention.triton_backend", "TritonAttentionBackend")

__all__ = ["AttentionBackend", "AttentionCapabilities", "check_attention_backend", "get_attention_backend",
           "register_attention_backend", "registered_attention_backends"]
