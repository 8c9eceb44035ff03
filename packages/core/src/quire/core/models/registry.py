"""What the engine knows about each model architecture, by Hugging Face name: ``ModelEntry`` and its registry.

This module imports no torch (``ModelConfig.from_hf`` reads it); a model class is imported on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from quire.core.errors import ConfigError

if TYPE_CHECKING:
    from quire.core.config import ModelConfig

# How many rows of a fused parameter one checkpoint tensor fills, from the normalised config.
RowCount = Callable[["ModelConfig"], int]


@dataclasses.dataclass(frozen=True)
class FusedWeight:
    """Checkpoint tensors stacked, in order, along the rows of one fused parameter.

    A checkpoint tensor whose name contains ``parts[i][0]`` is renamed with ``fused_part`` in its place and
    lands at the sum of the row counts of ``parts[:i]``; e.g. ``.k_proj.`` → ``.qkv_proj.`` after the
    query rows. ``scope``: only names that start with it (a model made of parts shaped differently, such as
    a vision tower beside a language model, fuses each part with its own row counts).
    """

    fused_part: str
    parts: tuple[tuple[str, RowCount], ...]
    scope: str = ""

    def applies_to(self, name: str) -> bool:
        return name.startswith(self.scope)

    def offsets(self, config: ModelConfig) -> list[tuple[str, int]]:
        """``(checkpoint name part, first row)`` of every part, in order."""
        offsets, start = [], 0
        for name_part, rows in self.parts:
            offsets.append((name_part, start))
            start += rows(config)
        return offsets


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """How checkpoint tensor names become ``(parameter name, first row)`` of a model's parameters.

    ``renamed_prefixes``: ``(checkpoint prefix, model prefix)`` pairs; the first that starts a name replaces
    its prefix before anything else is looked at (one model class reading several checkpoint layouts).
    ``skipped_suffixes``: tensors the model recomputes instead of loading (rotary inverse frequencies).
    ``tied_names``: tensors a model with ``tie_word_embeddings`` ignores, since it reuses the embedding.
    ``is_unused``: tensors of parts this config's model does not build (e.g. vision layers past the one
    whose output the model reads), by model name.
    """

    fused: tuple[FusedWeight, ...] = ()
    skipped_suffixes: tuple[str, ...] = ()
    tied_names: tuple[str, ...] = ()
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    is_unused: Callable[[str, ModelConfig], bool] | None = None

    def rename(self, name: str) -> str:
        """The checkpoint name in the model's layout."""
        for prefix, model_prefix in self.renamed_prefixes:
            if name.startswith(prefix):
                return model_prefix + name[len(prefix):]
        return name

    def is_skipped(self, name: str, config: ModelConfig) -> bool:
        name = self.rename(name)
        return (name.endswith(self.skipped_suffixes) or (config.tie_word_embeddings and name in self.tied_names)
                or (self.is_unused is not None and self.is_unused(name, config)))

    def target(self, name: str, config: ModelConfig) -> tuple[str, int]:
        """The parameter a checkpoint tensor fills and the row it starts at."""
        name = self.rename(name)
        for fused in self.fused:
            if not fused.applies_to(name):
                continue
            for name_part, offset in fused.offsets(config):
                if name_part in name:
                    return name.replace(name_part, fused.fused_part), offset
        return name, 0

    def part_rows(self, name: str, config: ModelConfig) -> int | None:
        """Rows of the fused parameter that the checkpoint tensor ``name`` fills (None: not a fused part)."""
        name = self.rename(name)
        for fused in self.fused:
            if fused.applies_to(name):
                for name_part, rows in fused.parts:
                    if name_part in name:
                        return rows(config)
        return None

    def expected_shards(self, parameter_names: Iterable[str], config: ModelConfig) -> set[tuple[str, int]]:
        """Every ``(parameter name, first row)`` a complete checkpoint fills."""
        expected = set()
        for name in parameter_names:
            fused = next((f for f in self.fused if f.applies_to(name) and f.fused_part in name), None)
            offsets = [offset for _, offset in fused.offsets(config)] if fused else [0]
            expected.update((name, offset) for offset in offsets)
        return expected


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One architecture: the model class to import, its ``ModelConfig`` fields and its checkpoint names.

    ``config_fields(hf)`` turns the raw ``config.json`` dict into the architecture-specific ``ModelConfig``
    fields (``qkv_bias``, ``o_proj_bias``, ``qk_norm``, …) and raises ConfigError for variants the model
    class cannot run; the fields every architecture shares are read by ``ModelConfig.from_hf`` itself.
    ``model_types`` are the ``model_type`` values that name this architecture in a config.json that lists
    no ``architectures``. ``text_config(hf)``, for configs that nest the language model's (vision-language
    models), returns that nested dict, complete, for ``ModelConfig.from_hf`` to read the shared fields from.
    The model class is built as ``cls(model_config, attention_backend)``.
    """

    architecture: str
    module_name: str
    class_name: str
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]
    weights: WeightMapping
    model_types: tuple[str, ...] = ()
    text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # The model class takes ``tensor_parallel_group=`` and splits its layers over the group's ranks.
    supports_tensor_parallel: bool = False

    def model_class(self) -> type:
        return getattr(importlib.import_module(self.module_name), self.class_name)


_ENTRIES: dict[str, ModelEntry] = {}


def register_model(entry: ModelEntry) -> None:
    """Make ``entry`` the one for its architecture (and for its model types)."""
    _ENTRIES[entry.architecture] = entry


def supported_architectures() -> list[str]:
    return sorted(_ENTRIES)


def check_architecture(architecture: str) -> None:
    """Raise ConfigError, listing what is supported, unless ``architecture`` is registered."""
    if architecture not in _ENTRIES:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: "
                          f"{', '.join(supported_architectures())}")


def get_model_entry(architecture: str) -> ModelEntry:
    check_architecture(architecture)
    return _ENTRIES[architecture]


def get_model_class(architecture: str) -> type:
    return get_model_entry(architecture).model_class()


def architecture_for_model_type(model_type: str) -> str | None:
    """The registered architecture a bare ``model_type`` names, or None."""
    return next((entry.architecture for entry in _ENTRIES.values() if model_type in entry.model_types), None)
