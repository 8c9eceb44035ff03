"""A one-node Ray cluster for a test module (``ray_cluster``), shared by the Ray tests of tensor and data
parallelism: ``ray start --head --block`` on 127.0.0.1 with 2 CPUs, ``RAY_ADDRESS`` pointing at it so that
engine cores join it whether they run in the test process or in their own."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.servers import free_port

# NOTE: one token for the whole test session, not ~/.ray/auth_token (other clusters of the machine may use
# it): Ray reads the token once per process, so every module's cluster must accept the same one.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}

CLUSTER_START_TIMEOUT_SECONDS = 60


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster of 2 CPUs on 127.0.0.1 for the module, in a session of its own that is
    stopped (with every process it started) at the end; ``RAY_ADDRESS`` (and its token) name it meanwhile."""
    address = f"127.0.0.1:{free_port()}"
    # NOTE: a token of the module's own, not ~/.ray/auth_token, which other clusters of this machine may use;
    # set before ray is imported, which reads it once
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in {"RAY_ADDRESS": address, **auth}.items():
            monkeypatch.setenv(name, value)
        ray = pytest.importorskip("ray", reason="the ray executor needs Ray (pip install 'quire-core[ray]')")
        temp_dir = tempfile.mkdtemp(prefix="quire-ray-")  # short: Ray's socket paths live under it
        command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus", "2",
                   "--node-ip-address", "127.0.0.1", "--port", address.split(":")[1], "--include-dashboard",
                   "false", "--disable-usage-stats", "--temp-dir", temp_dir]
        head = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            wait_for_cluster(ray, head)
            yield ray
            ray.shutdown()  # this process's connection (the in-process engine cores joined as a driver)
        finally:
            stop_session(head)
            shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_cluster(ray, head: subprocess.Popen) -> None:
    deadline = time.monotonic() + CLUSTER_START_TIMEOUT_SECONDS
    while True:
        try:
            if not ray.is_initialized():
                ray.init(include_dashboard=False, log_to_driver=False)
            if ray.cluster_resources().get("CPU") == 2:
                return
        except ConnectionError:
            pass
        assert head.poll() is None, "ray start exited"
        assert time.monotonic() < deadline, "the Ray cluster did not start"
        time.sleep(0.5)


def wait_for_every_cpu(ray) -> None:
    """Until both bundles' CPUs are back (Ray removes a placement group asynchronously)."""
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != 2:
        assert time.monotonic() < deadline, f"a placement group outlived its engine: {ray.available_resources()}"
        time.sleep(0.2)


def stop_session(head: subprocess.Popen) -> None:
    """SIGTERM to ``ray start --block`` (it stops its node's processes), then SIGKILL to whatever of its
    session is left."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait()
