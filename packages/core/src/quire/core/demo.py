"""quire-demo: the small model trained by the project (``tools/train_demo_model.py``) and shipped here,
so every entry point has a model to run on a fresh machine."""

from __future__ import annotations

from pathlib import Path

from quire.core.errors import ConfigError

DEMO_MODEL_NAME = "quire-demo"


def demo_model_path() -> Path:
    """The folder of the embedded quire-demo checkpoint (standard Hugging Face layout)."""
    path = Path(__file__).with_name("demo_model")
    if not (path / "config.json").is_file():
        raise ConfigError(f"the embedded {DEMO_MODEL_NAME} model is missing from this installation "
                          f"(expected it in {path})")
    return path
