"""Quire's C++ CPU kernels, compiled on first use with the machine's compiler and cached.

The build happens once per machine and source version (in torch's extension cache, about half a minute);
without a working compiler, or with ``QUIRE_CPU_KERNELS=0``, ``load()`` returns None and callers use the
PyTorch path instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / name for name in ("bindings.cpp", "paged_decode.cpp", "elementwise.cpp", "linear_bf16.cpp",
                                     "decode_stack.cpp")]
# included by the sources: part of the cache key
HEADERS = [_CSRC / name for name in ("bf16.h", "kernels.h", "decode_stack.h", "parallel.h")]


@functools.cache
def load():
    """The compiled module (``paged_decode``, ``rms_norm``, ``rotate``, ``silu_and_mul``, ``argmax_rows``,
    ``linear_bf16``, ``DecodeStack``), or None when it cannot be built here."""
    if os.environ.get("QUIRE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        _put_ninja_on_path()
        # -march=native: a build is only good for this CPU's instruction set, so its flags are in the key
        # (a home directory shared by different machines keeps one build per CPU kind).
        key = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)) + _cpu_flags()
        digest = hashlib.sha256(key).hexdigest()[:12]
        return build(name=f"quire_cpu_kernels_{digest}", sources=[str(s) for s in SOURCES],
                     extra_cflags=["-O3", "-ffast-math", "-march=native", "-fopenmp"],
                     extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # noqa: BLE001 - no compiler, no headers: the torch path still works
        logger.warning("Quire's C++ CPU kernels are unavailable (%s); using the PyTorch path", error)
        return None


def _cpu_flags() -> bytes:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor().encode()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "").encode()


def _put_ninja_on_path() -> None:
    # pip installs ninja's executable next to this interpreter, which may not be on PATH
    if shutil.which("ninja") is None:
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def for_tensor(x):
    """The kernels module if it can run on ``x`` (a float32 or bfloat16 CPU tensor), else None."""
    return load() if x.is_cpu and x.dtype in _SUPPORTED_DTYPES else None


_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
