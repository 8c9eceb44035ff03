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
class ExpertWeight:
    """Per-expert checkpoint tensors stacked into one ``[num_experts, rows, columns]`` parameter.

    A checkpoint tensor named ``<module>{experts}<e>.{parts[i][0]}`` (e.g. ``layers.0.mlp.experts.3.w3.weight``
    for ``experts`` ``.mlp.experts.`` and part ``w3.weight``) fills expert ``e``'s slice of the parameter
    ``<module>{experts}{stacked}``, after the rows of ``parts[:i]``. The loader fills such a parameter as
    ``[num_experts * rows, columns]``, so a checkpoint that stores it already stacked loads as it is.
    """

    experts: str
    stacked: str
    parts: tuple[tuple[str, RowCount], ...]

    def target(self, name: str, config: ModelConfig) -> tuple[str, int] | None:
        """The stacked parameter and first row a per-expert tensor fills, or None if ``name`` is not one."""
        start = name.find(self.experts)
        if start < 0:
            return None
        index, _, part = name[start + len(self.experts):].partition(".")
        if not index.isdigit():
            return None
        offsets = dict(self._part_offsets(config))
        if part not in offsets:
            return None
        return name[:start] + self.experts + self.stacked, int(index) * self._rows_per_expert(config) + offsets[part]

    def expected_offsets(self, parameter_name: str, config: ModelConfig) -> list[int] | None:
        """Every first row a complete checkpoint fills in ``parameter_name``, or None if this rule does not
        stack it."""
        if not parameter_name.endswith(self.experts + self.stacked):
            return None
        rows_per_expert = self._rows_per_expert(config)
        return [expert * rows_per_expert + offset for expert in range(config.num_experts)
                for _, offset in self._part_offsets(config)]

    def _part_offsets(self, config: ModelConfig) -> list[tuple[str, int]]:
        return FusedWeight(self.stacked, self.parts).offsets(config)

    def _rows_per_expert(self, config: ModelConfig) -> int:
        return sum(rows(config) for _, rows in self.parts)


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """How checkpoint tensor names become ``(parameter name, first row)`` of a model's parameters.

    ``renamed_prefixes``: ``(checkpoint prefix, model prefix)`` pairs; the first that starts a name replaces
    its prefix before anything else is looked at (one model class reading several checkpoint layouts).
    ``renamed_parts``: ``(checkpoint name part, model name part)`` pairs replaced wherever they occur, after
    the prefixes (Mixtral's ``.block_sparse_moe.`` is the model's ``.mlp.``).
    ``experts``: per-expert tensors stacked into one parameter per projection (looked at before ``fused``).
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
    renamed_parts: tuple[tuple[str, str], ...] = ()
    experts: tuple[ExpertWeight, ...] = ()

    def rename(self, name: str) -> str:
        """The checkpoint name in the model's layout."""
        for prefix, model_prefix in self.renamed_prefixes:
            if name.startswith(prefix):
                name = model_prefix + name[len(prefix):]
                break
        for part, model_part in self.renamed_parts:
            name = name.replace(part, model_part)
        return name

    def is_skipped(self, name: str, config: ModelConfig) -> bool:
        name = self.rename(name)
        return (name.endswith(self.skipped_suffixes) or (config.tie_word_embeddings and name in self.tied_names)
                or (self.is_unused is not None and self.is_unused(name, config)))

    def target(self, name: str, config: ModelConfig) -> tuple[str, int]:
        """The parameter a checkpoint tensor fills and the row it starts at."""
        name = self.rename(name)
        for rule in self.experts:
            stacked = rule.target(name, config)
            if stacked is not None:
                return stacked
        for fused in self.fused:
            if not fused.applies_to(name):
                continue
            for name_part, offset in fused.offsets(config):
                if name_part in name:
                    return name.replace(name_part, fused.fused_part), offset
        return name, 0

    def part_rows(self, name: str, config: ModelConfig) -> int | None:
        """Rows of the fused parameter that the checkpoint tensor ``name`` fills (None: not a fused part, or
        a per-expert tensor, which tensor parallelism does not split)."""
        name = self.rename(name)
        if any(rule.target(name, config) is not None for rule in self.experts):
            return None
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
            stacked = next((offsets for rule in self.experts
                            if (offsets := rule.expected_offsets(name, config)) is not None), None)
            if stacked is not None:
                expected.update((name, offset) for offset in stacked)
                continue
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
    models), returns that nested dict, complete, for ``ModelConfig.from_hf`` to read the shared fields from;
    a flat config may use it to fill in its config class's defaults and normalise its rope (Gemma 3).
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
