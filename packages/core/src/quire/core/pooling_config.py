"""How an embedding model turns a prompt's hidden states into one vector: ``PoolingConfig``, read from a model
folder's sentence-transformers files (``modules.json``, the Pooling module's ``config.json``,
``sentence_bert_config.json``) and refused, naming the file and key, where Quire would compute it differently.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from quire.core.errors import ConfigError

POOLING_TYPES = ("cls", "mean", "last")

# sentence-transformers' pooling modes, as its Pooling module names them, and what Quire computes for each
# (None: a mode Quire does not compute).
_POOLING_MODES: dict[str, str | None] = {
    "cls": "cls", "mean": "mean", "lasttoken": "last",
    "max": None, "mean_sqrt_len_tokens": None, "weightedmean": None,
}
# The layout sentence-transformers wrote before 5.x: one boolean per mode, in the order its Pooling
# concatenates them (the first true one is the mode; none true means mean).
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# The Transformer module's settings file, under each name sentence-transformers has given it.
_TRANSFORMER_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json",
                             "sentence_distilbert_config.json", "sentence_camembert_config.json",
                             "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                             "sentence_xlnet_config.json")
# Modules Quire runs, by class name (``modules.json`` types are dotted paths whose package moved between
# sentence-transformers versions: ``sentence_transformers.models.Pooling``,
# ``sentence_transformers.sentence_transformer.modules.pooling.Pooling``). Dropout is the identity at inference.
_TRANSFORMER, _POOLING, _NORMALIZE, _DROPOUT = "Transformer", "Pooling", "Normalize", "Dropout"
_NO_LIMIT = 10**29


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """One vector per prompt: ``pooling_type`` ("cls": the first token's hidden state; "mean": the average over
    the prompt's tokens; "last": the last token's), L2-normalised if ``normalize``.

    ``max_seq_length``: the token count sentence-transformers truncates a prompt to, from
    ``sentence_bert_config.json`` or else the tokenizer's ``model_max_length`` (None: the folder does not say);
    sentence-transformers also caps it at the model's ``max_position_embeddings``, as ``max_model_len`` does.
    ``lowercase_input``: sentence-transformers lowercases the text before tokenising (``do_lower_case``).
    ``source``: where these values came from, for messages and logs.
    """

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None
    lowercase_input: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")


def override_pooling_config(config: PoolingConfig | None, pooling_type: str | None = None,
                            normalize: bool | None = None) -> PoolingConfig | None:
    """``config`` (the folder's, or None) with the user's options over it; an option left None keeps the
    folder's value. With no folder config, ``pooling_type`` alone makes one (normalised unless ``normalize`` is
    False); with neither, None: the caller picks the model family's default."""
    if pooling_type is None and normalize is None:
        return config
    options = ", ".join(f"{name}={value!r}" for name, value in
                        (("pooling_type", pooling_type), ("normalize", normalize)) if value is not None)
    if config is None:
        if pooling_type is None:
            raise ConfigError("the model folder has no sentence-transformers pooling config: "
                              "pass pooling_type along with normalize")
        return PoolingConfig(pooling_type, True if normalize is None else normalize, source=f"options {options}")
    return dataclasses.replace(
        config, pooling_type=config.pooling_type if pooling_type is None else pooling_type,
        normalize=config.normalize if normalize is None else normalize,
        source=f"{config.source}, overridden by {options}")


def read_pooling_config(folder: str | Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers model folder describes, or None for a folder without
    ``modules.json``. Raises ConfigError, naming the file and key, for what Quire would compute differently
    from sentence-transformers: max, weighted or sqrt-length pooling, several poolings concatenated, Dense or
    other extra modules, an unknown pooling value."""
    folder = Path(folder)
    modules = _read_modules(folder)
    if modules is None:
        return None
    transformer, pooling, normalize = _check_module_order(modules)
    pooling_file = Path(pooling["path"]) / "config.json"
    pooling_type = _pooling_type(_read_json(folder, pooling_file), pooling_file.as_posix())
    if normalize is not None:
        _check_normalize(folder, Path(normalize["path"]) / "config.json")
    max_seq_length, lowercase_input = _transformer_settings(folder, Path(transformer["path"]))
    return PoolingConfig(pooling_type, normalize is not None, max_seq_length, lowercase_input,
                         source=f"{folder}/modules.json")


def _read_json(folder: Path, relative: Path) -> Any:
    """The JSON value in ``folder / relative``, None if there is no such file."""
    path = folder / relative
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{relative.as_posix()} in model folder {str(folder)!r} is not valid JSON: "
                          f"{error}") from None
    return value


def _read_modules(folder: Path) -> list[dict[str, Any]] | None:
    modules = _read_json(folder, Path("modules.json"))
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(
            isinstance(module, dict) and isinstance(module.get("type"), str) and isinstance(module.get("path", ""), str)
            for module in modules):
        raise ConfigError("modules.json must be a list of modules, each with a string type and path")
    return [{**module, "path": module.get("path", "")} for module in modules]


def _class_name(module: dict[str, Any]) -> str | None:
    """The module's sentence-transformers class name, or None for a class from elsewhere (custom code)."""
    type_name = module["type"]
    return type_name.rsplit(".", 1)[-1] if type_name.startswith("sentence_transformers.") else None


def _check_module_order(modules: list[dict[str, Any]]) -> tuple[dict, dict, dict | None]:
    """``(transformer, pooling, normalize or None)``: a Transformer, then one Pooling, then at most one
    Normalize (Dropout anywhere after the Transformer); anything else is refused."""
    kinds = []
    for index, module in enumerate(modules):
        kind = _class_name(module)
        if kind == "Dense":
            raise ConfigError(f"modules.json: module {index} ({module['type']}) projects the pooled vector through "
                              "a Dense layer, which Quire does not compute")
        if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE, _DROPOUT):
            raise ConfigError(f"modules.json: module {index} has type {module['type']!r}; Quire computes only "
                              "Transformer, Pooling and Normalize modules")
        kinds.append(kind)
    pipeline = [kind for kind in kinds if kind != _DROPOUT]
    if pipeline.count(_POOLING) > 1:
        raise ConfigError("modules.json lists several Pooling modules; Quire computes one pooling")
    if pipeline not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]) or kinds[0] != _TRANSFORMER:
        raise ConfigError(f"modules.json lists modules {kinds}; Quire computes a Transformer, then a Pooling, "
                          "then optionally a Normalize")
    by_kind = {kind: module for kind, module in zip(kinds, modules)}
    return by_kind[_TRANSFORMER], by_kind[_POOLING], by_kind.get(_NORMALIZE)


def _pooling_type(config: dict[str, Any] | None, file: str) -> str:
    """Quire's pooling type for a Pooling module's config, in the compact layout (``"pooling_mode": "mean"``,
    or a list of modes) or the legacy one (``"pooling_mode_mean_tokens": true``, …)."""
    if config is None:
        raise ConfigError(f"{file} is missing; modules.json names a Pooling module there")
    if not isinstance(config, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    unknown = sorted(key for key in config if key.startswith("pooling_mode_") and key not in _LEGACY_POOLING_KEYS)
    if unknown:
        raise ConfigError(f"{file}: key {unknown[0]!r} is not a pooling mode Quire knows")
    # NOTE: include_prompt false is accepted: it drops the tokens of a prompt sentence-transformers prepends
    # itself, and Quire prepends none.
    if "pooling_mode" in config:  # the compact layout wins over legacy keys, as in sentence-transformers
        key, value = "pooling_mode", config["pooling_mode"]
        modes = value if isinstance(value, list) else [value]
    else:
        key = "pooling_mode_*"
        modes = [mode for name, mode in _LEGACY_POOLING_KEYS.items() if config.get(name)] or ["mean"]
    if len(modes) != 1:
        raise ConfigError(f"{file}: {key} names {len(modes)} poolings to concatenate ({modes}); "
                          "Quire computes exactly one")
    mode = modes[0]
    pooling_type = _POOLING_MODES.get(mode) if isinstance(mode, str) else None
    if pooling_type is None:
        is_known = isinstance(mode, str) and mode in _POOLING_MODES
        what = "is not supported" if is_known else "is not a pooling mode Quire knows"
        raise ConfigError(f"{file}: {key} {mode!r} {what} (supported: cls, mean, lasttoken)")
    return pooling_type


def _check_normalize(folder: Path, file: Path) -> None:
    config = _read_json(folder, file) or {}  # sentence-transformers writes no file for the default Normalize
    if not isinstance(config, dict):
        raise ConfigError(f"{file.as_posix()} must hold a JSON object")
    for key in ("module_input_name", "module_output_name"):
        value = config.get(key)
        if value not in (None, "sentence_embedding"):
            raise ConfigError(f"{file.as_posix()}: {key} {value!r} normalises something other than the pooled "
                              "vector, which Quire does not compute")


def _transformer_settings(folder: Path, module_path: Path) -> tuple[int | None, bool]:
    """``(max_seq_length, do_lower_case)`` of the Transformer module: its settings file's values, the length
    falling back on the tokenizer's ``model_max_length`` (where sentence-transformers 5+ saves it)."""
    file, config = _first_file(folder, [module_path / name for name in _TRANSFORMER_CONFIG_FILES])
    config = config or {}
    task = config.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ConfigError(f"{file.as_posix()}: transformer_task {task!r} does not output token embeddings; "
                          "Quire pools the last hidden states (feature-extraction)")
    max_seq_length = _positive_int_or_none(config.get("max_seq_length"), file, "max_seq_length")
    if max_seq_length is None:
        tokenizer_file = module_path / "tokenizer_config.json"
        tokenizer_config = _read_json(folder, tokenizer_file)
        length = tokenizer_config.get("model_max_length") if isinstance(tokenizer_config, dict) else None
        # transformers writes int(1e30) for a tokenizer without a limit
        if isinstance(length, int) and not isinstance(length, bool) and 0 < length < _NO_LIMIT:
            max_seq_length = length
    lowercase = config.get("do_lower_case", False)
    if not isinstance(lowercase, bool):
        raise ConfigError(f"{file.as_posix()}: do_lower_case must be true or false, got {lowercase!r}")
    return max_seq_length, lowercase


def _first_file(folder: Path, candidates: list[Path]) -> tuple[Path, dict[str, Any] | None]:
    """The first of ``candidates`` that exists, and its JSON object (the first candidate and None if none does)."""
    for file in candidates:
        config = _read_json(folder, file)
        if config is not None:
            if not isinstance(config, dict):
                raise ConfigError(f"{file.as_posix()} must hold a JSON object")
            return file, config
    return candidates[0], None


def _positive_int_or_none(value: Any, file: Path, key: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{file.as_posix()}: {key} must be a positive integer or null, got {value!r}")
    return value
