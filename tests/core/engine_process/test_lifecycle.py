"""Start-up, death and shutdown of the engine core process."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core import SamplingParams
from quire.core.errors import ConfigError, EngineDeadError
from quire.offline import LLM
from tests.core.engine_process.conftest import engine_children, kill, pid_alive, run
from tests.core.reference import reference_greedy


def test_greedy_over_zmq_equals_in_process_and_transformers(llama_checkpoint, corpus_token_ids):
    prompts = [corpus_token_ids[i * 100:i * 100 + n] for i, n in enumerate((5, 40, 120))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    over_zmq = LLM(llama_checkpoint, dtype="float32", max_model_len=256, multiprocess=True, num_threads=1)
    in_process = LLM(llama_checkpoint, dtype="float32", max_model_len=256, multiprocess=False)
    zmq_ids = [o.outputs[0].token_ids for o in over_zmq.generate(prompts, params, use_tqdm=False)]
    local_ids = [o.outputs[0].token_ids for o in in_process.generate(prompts, params, use_tqdm=False)]
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    assert zmq_ids == local_ids == [reference_greedy(model, p, 12) for p in prompts]
    # a stop-string finish is aborted in the engine, over the socket too
    text = over_zmq.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].text
    stopped = over_zmq.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12, stop=[text[4:7]]),
                                use_tqdm=False)[0]
    assert stopped.outputs[0].finish_reason == "stop"
    over_zmq.llm_engine.check_idle_invariants()
    client = over_zmq.llm_engine.engine_core
    assert client.call_utility("get_stats")["num_threads"] == 1  # in the engine process only
    assert torch.get_num_threads() == in_process.llm_engine.get_stats()["num_threads"]
    pid, socket_dir = client.process.pid, Path(client._resources.socket_dir)
    assert socket_dir.is_dir()
    assert_malloc_on_huge_pages(pid)
    over_zmq.shutdown()
    assert not pid_alive(pid) and not socket_dir.exists()


def assert_malloc_on_huge_pages(pid: int) -> None:
    """The engine process starts with glibc's malloc asking for transparent huge pages, and (where glibc and
    the kernel offer them: glibc 2.35 on, transparent huge pages not "never") its large blocks are on them."""
    environment = dict(entry.split("=", 1) for entry in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in entry)
    # NOTE: glibc (2.36 here) rewrites the string it was given as it parses it: /proc showed only the first of three
    assert "glibc.malloc.hugetlb=1" in environment["GLIBC_TUNABLES"].split(":")
    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if (libc.startswith("glibc ") and tuple(map(int, libc.split()[1].split(".")[:2])) >= (2, 35)
            and thp.exists() and "[never]" not in thp.read_text()):
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        huge_kb = int(rollup.split("AnonHugePages:")[1].split()[0])
        assert huge_kb >= 2048, rollup


ENGINE_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432"
                   ":glibc.malloc.trim_threshold=1099511627776")


def test_the_caller_s_own_malloc_tunables_reach_the_engine_and_a_choice_of_its_own_wins(monkeypatch):
    from quire.core.engine.mp_client import engine_environment

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert engine_environment()["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{ENGINE_TUNABLES}"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert engine_environment()["GLIBC_TUNABLES"] == (
        "glibc.malloc.hugetlb=0:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1099511627776")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=65536")
    assert engine_environment()["GLIBC_TUNABLES"] == (
        "glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=65536:glibc.malloc.hugetlb=1")
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert engine_environment()["GLIBC_TUNABLES"] == ENGINE_TUNABLES


MALLOC_PROBE = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
mapped = libc.mallinfo2().hblkhd
block = libc.malloc(20 << 20)
print("mapped" if libc.mallinfo2().hblkhd - mapped >= 20 << 20 else "heap")
"""


def test_an_engine_s_prompt_sized_blocks_come_from_the_heap_not_fresh_maps(monkeypatch):
    """With the engine's environment glibc keeps a 20 MB block (a prompt step's MLP intermediate is up to 16 MiB,
    its other buffers smaller) in the heap, where a freed one is reused, rather than mapping it afresh as its
    default threshold does."""
    from quire.core.engine.mp_client import engine_environment

    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if not libc.startswith("glibc ") or tuple(map(int, libc.split()[1].split(".")[:2])) < (2, 33):
        pytest.skip("mallinfo2 and these tunables are glibc's (2.33 on)")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    probe = [sys.executable, "-c", MALLOC_PROBE]
    plain = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=60)
    engine = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=60, env=engine_environment())
    assert (plain.stdout.strip(), engine.stdout.strip()) == ("mapped", "heap")


def test_sigkill_of_the_engine_fails_every_waiting_caller(make_async_llm):
    engine = make_async_llm(faults="step_delay_ms=10")

    async def main():
        async def consume(i):
            async for _ in engine.generate(f"x{i}", SamplingParams(max_tokens=200, ignore_eos=True), str(i)):
                pass

        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        await asyncio.sleep(0.5)
        kill(engine.engine_core.process.pid)
        started = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - started < 5
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            engine.check_health()
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            await consume(99)

    run(main())
    time.sleep(0.2)
    assert engine_children() == []


def test_an_engine_side_exception_kills_the_engine_cleanly(make_async_llm):
    engine = make_async_llm(faults="fail_after_steps=3")

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("x", SamplingParams(max_tokens=50, ignore_eos=True), "a"):
                pass
        with pytest.raises(EngineDeadError):
            engine.check_health()

    started = time.monotonic()
    run(main())
    assert time.monotonic() - started < 5
    engine.engine_core.process.wait(timeout=10)
    assert engine.engine_core.process.returncode == 1


def test_the_engine_exits_when_the_front_end_is_killed(llama_checkpoint, tmp_path):
    script = tmp_path / "front_end.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from quire.offline import LLM
        llm = LLM({str(llama_checkpoint)!r}, dtype="float32", max_model_len=128, multiprocess=True)
        client = llm.llm_engine.engine_core
        print(client.process.pid, client._resources.socket_dir, flush=True)
        time.sleep(300)
    """))
    front_end = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid, socket_dir = front_end.stdout.readline().split()
        engine_pid = int(engine_pid)
        assert pid_alive(engine_pid)
        os.kill(front_end.pid, signal.SIGKILL)
        front_end.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pid_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(engine_pid), "the engine outlived its front end by 10 s"
        assert not Path(socket_dir).exists()
    finally:
        front_end.kill()


def test_start_up_failures_are_quick_and_name_the_cause(llama_checkpoint, tmp_path):
    started = time.monotonic()
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=str(missing)):
        LLM(missing, multiprocess=True)
    with pytest.raises(ConfigError, match="kv_cache_memory") as info:
        LLM(llama_checkpoint, dtype="float32", kv_cache_memory=10_000, multiprocess=True)
    assert "failed to start" in str(info.value)
    assert time.monotonic() - started < 15
    assert engine_children() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a CUDA device this machine lacks")
def test_async_engine_start_up_failure_names_the_cause(llama_checkpoint):
    """A failure inside the engine process at start-up reaches AsyncLLM's caller as a ConfigError naming
    it (and nothing is left running)."""
    from quire.core import EngineArgs
    from quire.core.engine.async_llm import AsyncLLM

    started = time.monotonic()
    args = EngineArgs(model=str(llama_checkpoint), device="cuda")
    with pytest.raises(ConfigError, match="failed to start.*no CUDA device"):
        AsyncLLM.from_engine_args(args)
    assert time.monotonic() - started < 15
    assert engine_children() == []
