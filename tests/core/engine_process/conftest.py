"""Fixtures for tests that run the engine core in its own process."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from quire.core import EngineArgs
from quire.core.engine.async_llm import AsyncLLM
from quire.core.engine.faults import ENV_VAR as FAULTS_ENV


def engine_children() -> list[int]:
    """Pids of engine-core processes whose parent is this test process."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"quire.core.engine.core_proc" in cmdline:
            pids.append(int(proc.name))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return state.exists() and state.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def make_async_llm(llama_checkpoint, monkeypatch):
    """``make_async_llm(faults=None, **engine_args)`` → a started AsyncLLM, shut down after the test."""
    created = []

    def make(faults: str | None = None, **kwargs):
        if faults:
            monkeypatch.setenv(FAULTS_ENV, faults)
        else:
            monkeypatch.delenv(FAULTS_ENV, raising=False)
        args = EngineArgs(model=str(llama_checkpoint), dtype="float32", max_model_len=256, **kwargs)
        engine = AsyncLLM.from_engine_args(args)
        created.append(engine)
        return engine

    yield make
    for engine in created:
        engine.shutdown()


def run(coroutine, timeout: float = 120):
    """Run a coroutine with a hard time limit (every load loop here is bounded)."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
