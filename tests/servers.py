"""Starting the real server as a subprocess on a free loopback port (bounded waits everywhere)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_SECONDS = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (the server starts its engine from a worker thread)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass  # the thread ended meanwhile
    return children


class ServerProcess:
    """``python -m quire.openai_server`` with the given arguments, up until ``stop()`` (which removes its log:
    a server that fails to start puts the log's tail in the error instead)."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "quire.openai_server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning", *args]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"quire-server-{self.port}.log"
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"the server exited during start-up:\n{tail}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not become healthy in time")

    def engine_pid(self) -> int:
        return child_pids(self.process.pid)[0]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log_file.close()
        self.log.unlink(missing_ok=True)
        return self.process.returncode

    def url(self, path: str) -> str:
        return self.base_url + path
