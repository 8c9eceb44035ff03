"""Quire's C++ CPU kernels: built once per machine and source version with the machine's compiler, then loaded.

The build goes into torch's extension cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``) and
takes 1-3 minutes on 2 cores; ``python -m quire.kernels build`` does it ahead of time, otherwise the
first process that needs the kernels does. Without a working compiler, after a failed build (remembered, see
``build_guard``), or with ``QUIRE_CPU_KERNELS=0``, ``load()`` returns None and callers use the PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from quire.kernels.build_guard import RETRY_COMMAND, remembered_failure, run_exclusively

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / name for name in ("bindings.cpp", "paged_decode.cpp", "elementwise.cpp", "linear_bf16.cpp",
                                     "decode_stack.cpp", "quant_linear.cpp", "onednn_gemv.cpp",
                                     "prefill_attention.cpp", "prefill_sdpa_order.cpp")]
# included by the sources: part of the cache key
HEADERS = [_CSRC / name for name in ("amx.h", "bf16.h", "kernels.h", "decode_stack.h", "parallel.h", "vector_math.h",
                                     "quant_blocks.h", "quant_int_dot.h", "greedy_screen.h")]
# NOTE: no -ffast-math: the kernels promise PyTorch's results for infinities and NaN (and its bits for
# bfloat16), which -ffinite-math-only and -fassociative-math would let the compiler break.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def load() -> ModuleType | None:
    """The compiled module (``paged_decode``, ``rms_norm``, ``rotate``, ``silu_and_mul``, ``argmax_rows``,
    ``linear_bf16``, ``DecodeStack``), or None when the PyTorch path runs instead (decided once per process).

    Loading an existing build is quiet and takes well under a second; building takes minutes and is announced.
    A failed build is remembered: later calls (in any process) skip it and log why and how to retry."""
    return _outcome().module


def build() -> ModuleType:
    """Build the kernels for this machine now, or load the existing build, for an explicit build step.

    Unlike ``load()``, it tries again after a remembered failure, ignores ``QUIRE_CPU_KERNELS`` and raises
    ``build_guard.KernelBuildError`` (whose message names the cause) instead of returning None."""
    return _build_or_load(retry_failed=True)


def describe(build: bool = False) -> str:
    """One line naming the CPU kernel path of this process and why, such as "C++ CPU kernels (built;
    bfloat16 linear: onednn)" or "PyTorch fallback: QUIRE_CPU_KERNELS=0".

    With ``build`` false (the default) it never compiles: a missing build is reported as not built yet and a
    remembered failure as such, and an existing build is loaded (well under a second) to report on it. With
    ``build`` true it calls ``load()`` first, which builds the kernels if needed (minutes)."""
    if not build and not _is_disabled() and _outcome.cache_info().currsize == 0:
        directory = build_directory()
        failure = remembered_failure(directory)
        if failure is not None:
            return f"PyTorch fallback: {failure}"
        if not _library_path(directory).exists():
            return f"C++ CPU kernels not built yet (the first process to use them builds them, or `{RETRY_COMMAND}`)"
    outcome = _outcome()
    if outcome.module is None:
        return f"PyTorch fallback: {outcome.reason}"
    from quire.kernels.linear import bf16_path

    return f"C++ CPU kernels (built; bfloat16 linear: {bf16_path()})"


def build_directory() -> Path:
    """Where this machine's build of the current sources lives (in torch's extension cache; created if
    missing). Its name carries a digest of everything the build depends on."""
    # NOTE: torch's own choice for the extension (its cache root, per Python version and accelerator): a
    # private function, but the one that knows torch's layout.
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_extension_name(), verbose=False))


def for_tensor(x):
    """The kernels module if it can run on ``x`` (a float32 or bfloat16 CPU tensor), else None."""
    return load() if x.is_cpu and x.dtype in _SUPPORTED_DTYPES else None


_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _Outcome:
    module: ModuleType | None
    reason: str  # why the PyTorch path runs, when module is None


@functools.cache
def _outcome() -> _Outcome:
    if _is_disabled():
        return _Outcome(None, "QUIRE_CPU_KERNELS=0")
    try:
        return _Outcome(_build_or_load(retry_failed=False), "")
    except Exception as error:  # noqa: BLE001 - no compiler, no headers, a failed build: the torch path still works
        logger.warning("Quire's C++ CPU kernels are unavailable (%s); using the PyTorch path", error)
        return _Outcome(None, str(error))


def _is_disabled() -> bool:
    return os.environ.get("QUIRE_CPU_KERNELS", "1") == "0"


def _build_or_load(retry_failed: bool) -> ModuleType:
    directory = build_directory()
    return run_exclusively(directory, functools.partial(_compile_and_import, directory), retry_failed=retry_failed,
                           is_built=lambda: _library_path(directory).exists())


def _compile_and_import(directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load as torch_load

    _put_ninja_on_path()
    # checked under the build lock: a process that waited for another one's build finds it done
    is_new_build = not _library_path(directory).exists()
    if is_new_build:
        logger.warning("Building Quire's C++ CPU kernels for this machine (once per source version; 1-3 minutes "
                       "on 2 cores)... run `%s` ahead of time to avoid this wait", RETRY_COMMAND)
    start = time.monotonic()
    # NOTE: fresh lists: torch appends its own flags to them, and a second load in this process with other
    # flags than the first would count as a new version of the extension (a rebuild under another name).
    module = torch_load(name=_extension_name(), sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                        extra_ldflags=list(LDFLAGS), build_directory=str(directory), verbose=False)
    if is_new_build:
        logger.warning("Built Quire's C++ CPU kernels in %.0f s (%s)", time.monotonic() - start, directory)
    return module


@functools.cache
def _extension_name() -> str:
    # -march=native: a build is only good for this CPU's instruction set, so its flags are in the key (a home
    # directory shared by different machines keeps one build per CPU kind); so are the compiler flags and
    # torch's version, which a remembered failure depends on as much as on the sources.
    key = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)) + _cpu_flags()
    key += " ".join([*CFLAGS, *LDFLAGS, torch.__version__]).encode()
    return f"quire_cpu_kernels_{hashlib.sha256(key).hexdigest()[:12]}"


def _library_path(directory: Path) -> Path:
    from torch.utils.cpp_extension import LIB_EXT

    return directory / f"{_extension_name()}{LIB_EXT}"


def _cpu_flags() -> bytes:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor().encode()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "").encode()


def _put_ninja_on_path() -> None:
    """Put the ninja pip installed next to this interpreter (a dependency) first on PATH.

    NOTE: not only when PATH has no ninja: a system ninja of another version reads the build directory's
    log as stale and rebuilds every object, so a shell with the environment activated and one calling its
    interpreter directly would rebuild the kernels in turn (1.11 against 1.13: 2-3 minutes each time)."""
    bin_dir = Path(sys.executable).parent
    own = bin_dir / ("ninja.exe" if os.name == "nt" else "ninja")
    found = shutil.which("ninja")
    if found is None or (own.is_file() and Path(found).resolve() != own.resolve()):
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
