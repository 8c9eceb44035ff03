"""The C++ CPU kernels' build: stale locks are cleared, failed builds are remembered, and the CLI reports.

The lock and marker handling (``build_guard``) runs against temporary directories with fake builders; the
subprocess tests use the real extension, built once by the suite (they never compile).
"""

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from quire.kernels import cpu_extension
from quire.kernels.build_guard import (
    FAILURE_MARKER_NAME,
    RETRY_COMMAND,
    TORCH_LOCK_NAME,
    KernelBuildError,
    exclusive_access,
    run_exclusively,
)

# A guard against hanging, far below the engine's 600 s start-up timeout; no test expects to come near it.
HANG_GUARD_S = 180


class FakeBuilder:
    def __init__(self, error: Exception | None = None, result="module"):
        self.error, self.result, self.num_calls = error, result, 0

    def __call__(self):
        self.num_calls += 1
        if self.error is not None:
            raise self.error
        return self.result


# The quire-demo model in an engine-core process of its own, as `quire serve` starts it; prints whether the
# C++ kernels loaded here and how many tokens a request got.
ENGINE_START = (
    "from quire.kernels import cpu_extension\n"
    "from quire.offline import LLM, SamplingParams\n"
    "llm = LLM(dtype='float32')\n"
    "out = llm.generate('import os', SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]\n"
    "print(cpu_extension.load() is not None, len(out.outputs[0].token_ids))\n"
    "llm.shutdown()\n"
)


def run_python(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, **env})


def test_a_stale_torch_lock_is_removed_before_the_builder_runs(tmp_path, caplog):
    directory = tmp_path / "quire_cpu_kernels_test"
    directory.mkdir()
    (directory / TORCH_LOCK_NAME).touch()  # torch's lock file, left by a build killed half-way

    def builder():
        assert not (directory / TORCH_LOCK_NAME).exists()
        return "module"

    with caplog.at_level(logging.WARNING, logger="quire.kernels.build_guard"):
        assert run_exclusively(directory, builder, retry_failed=False) == "module"
    assert "stale lock" in caplog.text


def test_the_lock_of_a_killed_builder_is_released_and_its_torch_lock_cleared(tmp_path):
    directory = tmp_path / "quire_cpu_kernels_test"
    # a builder that takes torch's lock and is killed inside the build
    script = (f"import os, pathlib, sys; from quire.kernels.build_guard import run_exclusively\n"
              f"directory = pathlib.Path({str(directory)!r})\n"
              f"def builder():\n"
              f"    (directory / {TORCH_LOCK_NAME!r}).touch(); print('building', flush=True); os.kill(os.getpid(), 9)\n"
              f"run_exclusively(directory, builder, retry_failed=False)\n")
    killed = run_python("-c", script)
    assert killed.returncode == -9 and "building" in killed.stdout
    assert (directory / TORCH_LOCK_NAME).exists()
    builder = FakeBuilder()
    assert run_exclusively(directory, builder, retry_failed=False) == "module"
    assert builder.num_calls == 1 and not (directory / TORCH_LOCK_NAME).exists()
    assert not (directory / FAILURE_MARKER_NAME).exists()  # a killed build is not a failed one


def test_a_process_waits_for_a_live_builder(tmp_path, caplog):
    directory = tmp_path / "quire_cpu_kernels_test"
    builder = FakeBuilder()
    with caplog.at_level(logging.WARNING, logger="quire.kernels.build_guard"):
        with exclusive_access(directory):  # another build in progress
            waiter = threading.Thread(target=run_exclusively, args=(directory, builder), kwargs={"retry_failed": False})
            waiter.start()
            waiter.join(timeout=1.0)
            assert waiter.is_alive() and builder.num_calls == 0
        waiter.join(timeout=HANG_GUARD_S)
    assert not waiter.is_alive() and builder.num_calls == 1
    assert "Waiting for another process" in caplog.text


def test_a_failed_build_is_remembered_until_retried(tmp_path):
    directory = tmp_path / "quire_cpu_kernels_test"
    failing = FakeBuilder(RuntimeError("Error building extension: c++: not found"))
    with pytest.raises(KernelBuildError, match="c\\+\\+: not found") as first:
        run_exclusively(directory, failing, retry_failed=False)
    assert RETRY_COMMAND in str(first.value)
    assert "c++: not found" in (directory / FAILURE_MARKER_NAME).read_text()

    builder = FakeBuilder()
    with pytest.raises(KernelBuildError, match="earlier build failed") as second:
        run_exclusively(directory, builder, retry_failed=False)
    assert builder.num_calls == 0 and failing.num_calls == 1
    assert RETRY_COMMAND in str(second.value) and "c++: not found" in str(second.value)

    assert run_exclusively(directory, builder, retry_failed=True) == "module"  # the explicit build step
    assert builder.num_calls == 1 and not (directory / FAILURE_MARKER_NAME).exists()
    assert run_exclusively(directory, builder, retry_failed=False) == "module"


def test_a_build_that_only_failed_to_load_here_is_not_remembered(tmp_path):
    # the library is on disk; importing it raised in this process (as when a second build of the kernels has
    # registered the same types first), which says nothing of other processes
    directory = tmp_path / "quire_cpu_kernels_test"
    failing = FakeBuilder(ImportError('generic_type: type "DecodeStack" is already registered!'))
    with pytest.raises(KernelBuildError, match="could not be loaded into this process"):
        run_exclusively(directory, failing, retry_failed=False, is_built=lambda: True)
    assert not (directory / FAILURE_MARKER_NAME).exists()
    builder = FakeBuilder()
    assert run_exclusively(directory, builder, retry_failed=False, is_built=lambda: True) == "module"
    assert builder.num_calls == 1


def test_a_failed_build_is_remembered_across_processes(tmp_path):
    # a compiler that fails at once: no compile happens, in a private extension cache
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false", "QUIRE_CPU_KERNELS": "1"}
    load = "from quire.kernels import cpu_extension; print(cpu_extension.load())"
    first = run_python("-c", load, **env)
    assert first.returncode == 0 and first.stdout.strip() == "None", first.stderr
    assert "the build failed" in first.stderr and RETRY_COMMAND in first.stderr
    assert list(tmp_path.rglob(FAILURE_MARKER_NAME))

    second = run_python("-c", load, **env)
    assert second.returncode == 0 and second.stdout.strip() == "None", second.stderr
    assert "earlier build failed" in second.stderr and RETRY_COMMAND in second.stderr
    assert "Building" not in second.stderr  # the build was not tried again

    status = run_python("-m", "quire.kernels", "status", **env)
    assert status.returncode == 0 and status.stdout.startswith("PyTorch fallback: an earlier build failed")

    retried = run_python("-m", "quire.kernels", "build", **env)
    assert retried.returncode == 1 and "Building" in retried.stderr and "could not be built" in retried.stderr


def test_status_reports_a_missing_build_without_building(tmp_path):
    status = run_python("-m", "quire.kernels", "status", TORCH_EXTENSIONS_DIR=str(tmp_path), QUIRE_CPU_KERNELS="1")
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("C++ CPU kernels not built yet") and RETRY_COMMAND in status.stdout
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.o"))


def test_status_names_the_fallback_when_disabled():
    status = run_python("-m", "quire.kernels", "status", QUIRE_CPU_KERNELS="0")
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip() == "PyTorch fallback: QUIRE_CPU_KERNELS=0"


def test_status_names_the_active_path():
    status = run_python("-m", "quire.kernels", "status")
    assert status.returncode == 0, status.stderr
    if cpu_extension.load() is not None and os.environ.get("QUIRE_CPU_KERNELS", "1") != "0":
        assert status.stdout.startswith("C++ CPU kernels (built; bfloat16 linear: ")
    else:
        assert status.stdout.startswith("PyTorch fallback: ")


def test_the_build_command_loads_an_existing_build():
    if cpu_extension.load() is None:
        pytest.skip("the C++ CPU kernels do not build on this machine")
    built = run_python("-m", "quire.kernels", "build", QUIRE_CPU_KERNELS="1")
    assert built.returncode == 0, built.stderr
    assert built.stdout.startswith("C++ CPU kernels (built; ") and "Building" not in built.stderr


def test_the_environment_s_own_ninja_runs_the_build_whatever_else_path_holds(tmp_path):
    """Another ninja earlier on PATH (a system one of another version) is not used: it would read the build's
    log as stale and rebuild everything."""
    if cpu_extension.load() is None:
        pytest.skip("the C++ CPU kernels do not build on this machine")
    other = tmp_path / "bin"
    other.mkdir()
    marker = tmp_path / "the other ninja ran"
    # it passes the work on to the real one, so that a failure here leaves the build directory as it was
    own = Path(sys.executable).parent / "ninja"
    if not own.is_file():
        pytest.skip("no ninja next to this interpreter")
    (other / "ninja").write_text(f"#!/bin/sh\ntouch '{marker}'\nexec '{own}' \"$@\"\n")
    (other / "ninja").chmod(0o755)
    built = run_python("-m", "quire.kernels", "build", QUIRE_CPU_KERNELS="1",
                       PATH=f"{other}{os.pathsep}{os.environ.get('PATH', '')}")
    assert built.returncode == 0, built.stderr
    assert built.stdout.startswith("C++ CPU kernels (built; ") and "Building" not in built.stderr
    assert not marker.exists()


def test_an_engine_starts_past_a_stale_torch_lock_in_the_real_build_directory():
    """A build killed half-way leaves torch's lock behind: the next engine still starts (and generates)."""
    if cpu_extension.load() is None:  # builds here first if needed, so that the subprocess only loads
        pytest.skip("the C++ CPU kernels do not build on this machine")
    directory = cpu_extension.build_directory()
    stale_lock = directory / TORCH_LOCK_NAME
    # planted (and removed) under the build flock, so that no live build sees it appear or vanish
    with exclusive_access(directory):
        stale_lock.touch()
    try:
        loaded = run_python("-c", ENGINE_START, QUIRE_CPU_KERNELS="1", QUIRE_MULTIPROCESS_ENGINE="1")
    finally:
        with exclusive_access(directory):
            stale_lock.unlink(missing_ok=True)
    assert loaded.returncode == 0 and loaded.stdout.split() == ["True", "2"], loaded.stderr
    assert "stale lock" in loaded.stderr
