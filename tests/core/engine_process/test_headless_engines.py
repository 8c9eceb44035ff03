"""Data parallelism over several machines, shown on one: a headless launcher in a second network namespace
(its own host, linked to this one by a veth pair and nothing else) runs engine core 1 for a front end here,
over TCP to the front end's address and RPC port."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quire.core import SamplingParams
from quire.core.config import ParallelConfig
from quire.core.engine.remote_engines import EngineRegistrar, register_with_front_end
from quire.core.errors import ConfigError, EngineDeadError
from quire.offline import LLM
from tests.core.engine_process.conftest import pid_alive
from tests.servers import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NAMESPACE = f"quire-test-{os.getpid()}"
VETH_HOST, VETH_OTHER = f"qh{os.getpid() % 10**6}", f"qo{os.getpid() % 10**6}"
FRONT_END_ADDRESS, OTHER_HOST_ADDRESS = "10.213.7.1", "10.213.7.2"
ENGINE_OPTIONS = ("--dtype", "float32", "--max-model-len", "256", "--num-threads", "1")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture(scope="module")
def other_host():
    """A second network namespace holding only its loopback and one end of a veth pair to this one."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make a network namespace")
    if os.geteuid() != 0:
        pytest.skip("making a network namespace and a veth pair needs root (CAP_NET_ADMIN)")
    steps = [
        ("netns", "add", NAMESPACE),
        ("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_OTHER),
        ("link", "set", VETH_OTHER, "netns", NAMESPACE),
        ("addr", "add", f"{FRONT_END_ADDRESS}/30", "dev", VETH_HOST),
        ("link", "set", VETH_HOST, "up"),
        ("netns", "exec", NAMESPACE, "ip", "addr", "add", f"{OTHER_HOST_ADDRESS}/30", "dev", VETH_OTHER),
        ("netns", "exec", NAMESPACE, "ip", "link", "set", VETH_OTHER, "up"),
        ("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot make the second network namespace (ip {' '.join(step)}: "
                            f"{result.stderr.strip()})")
        yield NAMESPACE
    finally:
        _ip("netns", "del", NAMESPACE)  # takes its end of the veth pair, and so the pair, with it
        _ip("link", "del", VETH_HOST)


def start_headless(checkpoint, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", NAMESPACE, sys.executable, "-m", "quire.openai_server", str(checkpoint),
         "--headless", *ENGINE_OPTIONS, "--data-parallel-size", "2", "--data-parallel-start-rank", "1",
         "--data-parallel-size-local", "1", "--data-parallel-address", FRONT_END_ADDRESS,
         "--data-parallel-rpc-port", str(port)])


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def front_end(checkpoint, port: int) -> LLM:
    return LLM(checkpoint, dtype="float32", max_model_len=256, num_threads=1, data_parallel_size=2,
               data_parallel_size_local=1, data_parallel_address=FRONT_END_ADDRESS, data_parallel_rpc_port=port,
               multiprocess=True)


def children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(proc.name))
            except (OSError, ValueError):
                continue
    return found


def engine_core_of(launcher_pid: int) -> int:
    """The headless launcher's engine-core process (``ip netns exec`` execs the launcher in place)."""
    pids = [pid for pid in children(launcher_pid)
            if b"quire.core.engine.core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 1, pids
    return pids[0]


def local_engine_cores() -> list[int]:
    pids = []
    for pid in children(os.getpid()):
        try:
            if pid_alive(pid) and b"quire.core.engine.core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 97:i * 97 + n] for i, n in enumerate((3, 9, 17, 30, 5, 44))]


def test_headless_engine_in_another_namespace_serves_the_front_end(other_host, llama_checkpoint, prompts):
    port = free_port()
    headless = start_headless(llama_checkpoint, port)
    try:
        llm = front_end(llama_checkpoint, port)
        try:
            expected = [o.outputs[0].token_ids for o in
                        LLM(llama_checkpoint, dtype="float32", max_model_len=256, multiprocess=False)
                        .generate(prompts, GREEDY, use_tqdm=False)]
            ranks = [rank % 2 for rank in range(len(prompts))]  # half of them pinned to the other host
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False, data_parallel_rank=ranks)
            assert [o.outputs[0].token_ids for o in outputs] == expected
            engines = llm.llm_engine.get_stats()["engines"]
            assert [stats["num_steps"] > 0 for stats in engines] == [True, True], engines
            remote = engine_core_of(headless.pid)
            # the engine core runs in the other namespace: not this one's network
            assert os.readlink(f"/proc/{remote}/ns/net") != os.readlink("/proc/self/ns/net")
            assert headless.poll() is None
        finally:
            llm.shutdown()
        # the front end's shutdown stops the engine cores it reached, and their launcher exits cleanly
        assert headless.wait(timeout=15) == 0
    finally:
        stop(headless)


def test_killed_remote_engine_fails_the_front_end_promptly(other_host, llama_checkpoint, prompts):
    port = free_port()
    headless = start_headless(llama_checkpoint, port)
    try:
        llm = front_end(llama_checkpoint, port)
        try:
            remote = engine_core_of(headless.pid)
            os.kill(remote, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineDeadError):
                deadline = started + 5
                while time.monotonic() < deadline:  # the death is noticed within the bound, then every call fails
                    llm.generate(prompts[:2], GREEDY, use_tqdm=False, data_parallel_rank=1)
                    time.sleep(0.1)
            assert time.monotonic() - started < 5
            assert headless.wait(timeout=10) != 0  # its launcher reports the engine core's death
            assert wait_until(lambda: not local_engine_cores(), 5), "the front end's own engine core was not stopped"
        finally:
            llm.shutdown()
    finally:
        stop(headless)


def test_registrar_refuses_a_rank_it_does_not_await():
    port = free_port()
    registrar = EngineRegistrar("127.0.0.1", port, remote_ranks=[1], data_parallel_size=2)
    try:
        config = type("Config", (), {})()
        for rank, size, reason in ((0, 2, "rank 0 is not awaited"), (1, 3, "group of 2")):
            config.parallel = ParallelConfig(data_parallel_size=size, data_parallel_address="127.0.0.1",
                                             data_parallel_rpc_port=port)
            with pytest.raises(ConfigError, match=reason):
                register_with_front_end(config, rank, timeout=10)
        with pytest.raises(ConfigError, match="data_parallel_rpc_port"):
            EngineRegistrar("127.0.0.1", port, remote_ranks=[1], data_parallel_size=2)  # the port is taken
    finally:
        registrar.close()
