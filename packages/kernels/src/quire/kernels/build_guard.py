"""One process at a time builds or loads the C++ CPU kernels in a build directory; failed builds are remembered.

torch's ``cpp_extension.load`` serialises builds with a ``lock`` file that it creates and deletes itself: a build
killed half-way leaves the file behind, and every later process waits for it forever. Here each build or load
also runs under an ``fcntl.flock`` on ``<build directory>.lock``, which the operating system releases when its
holder dies, so it can never be stale. Only a holder of that flock enters torch's build for the directory: a
``lock`` file found by the holder was left by a dead process, and is removed.

A build that raised leaves its error in the directory (``quire-build-failed.txt``); later processes read it and
skip the build (minutes each) until it is retried on purpose (``python -m quire.kernels build``). An error raised
while the built library is on disk (loading it into this process failed: say a second build of the kernels had
already registered its types here) is raised but not remembered: the build itself succeeded. The directory
is named after a digest of the sources and the build's inputs, so a new source version builds afresh.
This module imports no torch: the tests drive it with fake builders.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

RETRY_COMMAND = "python -m quire.kernels build"
TORCH_LOCK_NAME = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory
FAILURE_MARKER_NAME = "quire-build-failed.txt"
_MAX_SUMMARY_CHARS = 160

T = TypeVar("T")


class KernelBuildError(RuntimeError):
    """The C++ CPU kernels could not be built or loaded here; the message says why and how to retry."""


def run_exclusively(build_directory: Path, builder: Callable[[], T], *, retry_failed: bool,
                    is_built: Callable[[], bool] = lambda: False) -> T:
    """``builder()`` (torch's build-or-load for ``build_directory``), run under the directory's flock.

    Raises ``KernelBuildError`` without calling ``builder`` when an earlier build failed here, unless
    ``retry_failed``. When ``builder`` raises, its error is written to the directory's failure marker and raised
    as ``KernelBuildError``; a success removes the marker. Where ``is_built()`` (the library is on disk) after
    ``builder`` raised, only loading it failed, in this process: the error is raised and not written.
    ``BaseException``s that are not ``Exception``s (an interrupt) pass through unrecorded: an interrupted build
    has not failed.
    """
    with exclusive_access(build_directory):
        earlier_failure = None if retry_failed else remembered_failure(build_directory)
        if earlier_failure is not None:
            raise KernelBuildError(earlier_failure)
        _remove_stale_torch_lock(build_directory)
        marker = build_directory / FAILURE_MARKER_NAME
        try:
            result = builder()
        except Exception as error:
            if is_built():
                reason = _summary(str(error))
                raise KernelBuildError(f"the built kernels could not be loaded into this process: {reason}") from error
            marker.write_text(f"{type(error).__name__}: {error}\n")
            raise KernelBuildError(f"the build failed: {_summary(str(error))} (the whole error is in {marker}; "
                                   f"retry with `{RETRY_COMMAND}`)") from error
        marker.unlink(missing_ok=True)
        return result


def remembered_failure(build_directory: Path) -> str | None:
    """Why the kernels are not built in ``build_directory`` when an earlier build failed there (one line that
    names the retry command), else None."""
    marker = build_directory / FAILURE_MARKER_NAME
    try:
        error = marker.read_text()
    except FileNotFoundError:
        return None
    return f"an earlier build failed: {_summary(error)} (see {marker}; retry with `{RETRY_COMMAND}`)"


@contextlib.contextmanager
def exclusive_access(build_directory: Path) -> Iterator[None]:
    """Hold the flock that admits one process at a time into torch's build of ``build_directory`` (created
    if missing). Waiting for another holder is announced in one line: that is a real build in progress."""
    build_directory.mkdir(parents=True, exist_ok=True)
    lock_path = build_directory.with_name(f"{build_directory.name}.lock")
    # NOTE: the lock belongs to this open file, not to the process: closing it (or dying) releases it, and a
    # second open file in the same process waits like another process would.
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("Waiting for another process that is building or loading Quire's C++ CPU kernels "
                           "(it holds %s)...", lock_path)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def _remove_stale_torch_lock(build_directory: Path) -> None:
    lock = build_directory / TORCH_LOCK_NAME
    try:
        lock.unlink()
    except FileNotFoundError:
        return
    logger.warning("Removed %s, a stale lock left by an interrupted build of Quire's C++ CPU kernels", lock)


def _summary(error: str) -> str:
    """One line of an error for a log line: a compiler's first ``error:`` (torch's message starts with the
    whole build command), else the first line; shortened."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or ["no message"]
    line = next((line for line in lines if "error:" in line), lines[0])
    if len(line) <= _MAX_SUMMARY_CHARS:
        return line
    return line[:_MAX_SUMMARY_CHARS - 3] + "..."
