"""Model architectures, registered by Hugging Face architecture name and imported lazily (torch-free)."""

from __future__ import annotations

from quire.core.models import architectures  # noqa: F401  (registers the built-in entries)
from quire.core.models.registry import (
    ModelEntry,
    check_architecture,
    get_model_class,
    get_model_entry,
    register_model,
    supported_architectures,
)

__all__ = ["ModelEntry", "check_architecture", "get_model_class", "get_model_entry", "register_model",
           "supported_architectures"]
