"""Loading a checkpoint's tokenizer (front end only: the engine core never touches text)."""

from __future__ import annotations

from quire.core.errors import ConfigError


def load_tokenizer(path: str):
    """A fast (``tokenizers``-backed) Hugging Face tokenizer from a local folder."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"could not load a tokenizer from {path!r}: {error}") from error
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ConfigError(f"the tokenizer in {path!r} is not a fast tokenizer (tokenizer.json needed)")
    return tokenizer
