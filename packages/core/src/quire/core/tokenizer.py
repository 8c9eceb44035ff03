"""Loading a checkpoint's tokenizer (front end only: the engine core never touches text)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from quire.core.errors import ConfigError

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """A fast (``tokenizers``-backed) Hugging Face tokenizer from a local folder, or from a GGUF file's
    metadata (converted by transformers once, then read from Quire's cache)."""
    from transformers import AutoTokenizer

    from quire.core.models.gguf import gguf_path

    gguf_file = gguf_path(path)
    if gguf_file is not None:
        path = str(gguf_tokenizer_folder(gguf_file))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"could not load a tokenizer from {path!r}: {error}") from error
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ConfigError(f"the tokenizer in {path!r} is not a fast tokenizer (tokenizer.json needed)")
    return tokenizer


def cache_directory() -> Path:
    """Quire's cache: ``$QUIRE_CACHE_DIR``, else ``$XDG_CACHE_HOME/quire`` (``~/.cache/quire``)."""
    if os.environ.get("QUIRE_CACHE_DIR"):
        return Path(os.environ["QUIRE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quire"


def gguf_tokenizer_folder(gguf_file: Path) -> Path:
    """A Hugging Face tokenizer folder (tokenizer.json, its config and chat template) made from the GGUF
    file's metadata. The conversion takes seconds for a large vocabulary, so its result is kept, keyed by the
    file's path, size and modification time."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    folder = cache_directory() / "gguf-tokenizers" / key
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer

    logger.info("converting the tokenizer of %s (once; kept in %s)", gguf_file.name, folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                  local_files_only=True)
    except (OSError, ValueError, KeyError, NotImplementedError) as error:
        raise ConfigError(f"could not read a tokenizer from GGUF file {gguf_file.name!r} ({error}); pass "
                          "--tokenizer with a Hugging Face tokenizer folder") from error
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        tokenizer.save_pretrained(str(scratch))
        try:
            scratch.rename(folder)  # atomic: a concurrent conversion of the same file may have won
        except OSError:
            if not (folder / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
