"""Several engine-core processes behind one client (``data_parallel_size``): routing, pinning, aborts,
utilities and the death of one engine."""

import asyncio
import threading
import time

import pytest

from quire.core import SamplingParams
from quire.core.engine.faults import ENV_VAR as FAULTS_ENV
from quire.core.engine_args import available_cpu_count
from quire.core.errors import EngineDeadError, ValidationError
from quire.offline import LLM
from tests.core.engine_process.conftest import kill, pid_alive, run

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dp_llm(llama_checkpoint):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULTS_ENV, "step_delay_ms=5")  # so that a long request is still running when looked at
        llm = LLM(llama_checkpoint, dtype="float32", max_model_len=256, data_parallel_size=2, multiprocess=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 97:i * 97 + n] for i, n in enumerate((3, 9, 17, 30, 5, 44, 12, 60))]


def engine_stats(llm) -> list[dict]:
    return llm.llm_engine.get_stats()["engines"]


def wait_until_dead(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


def test_greedy_ids_equal_one_engine_and_both_engines_serve(dp_llm, llama_checkpoint, prompts):
    single = LLM(llama_checkpoint, dtype="float32", max_model_len=256, multiprocess=False)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    before = [stats["num_steps"] for stats in engine_stats(dp_llm)]
    outputs = dp_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    per_engine = engine_stats(dp_llm)
    assert all(stats["num_steps"] > steps for stats, steps in zip(per_engine, before)), per_engine
    assert [stats["num_threads"] for stats in per_engine] == [max(1, available_cpu_count() // 2)] * 2
    client = dp_llm.llm_engine.engine_core
    assert client.num_blocks == sum(stats["num_blocks"] for stats in per_engine) == \
        dp_llm.llm_engine.get_stats()["num_blocks"]
    assert client.balancer.num_tracked_requests == 0
    assert dp_llm.reset_prefix_cache() is True
    dp_llm.llm_engine.check_idle_invariants()


def test_a_pinned_request_runs_on_its_engine_and_a_bad_rank_is_refused(dp_llm, prompts):
    before = [stats["num_steps"] for stats in engine_stats(dp_llm)]
    pinned = dp_llm.generate(prompts[:3], GREEDY, data_parallel_rank=1, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in pinned)
    after = [stats["num_steps"] for stats in engine_stats(dp_llm)]
    assert after[0] == before[0] and after[1] > before[1]
    for rank in (5, -1, 2):
        with pytest.raises(ValidationError, match="data_parallel_rank") as info:
            dp_llm.generate(prompts[0], GREEDY, data_parallel_rank=rank, use_tqdm=False)
        assert info.value.param == "data_parallel_rank"
    assert not dp_llm.llm_engine.has_unfinished_requests()


def test_aborting_a_running_request_frees_its_engine_blocks(dp_llm, prompts):
    engine = dp_llm.llm_engine
    engine.add_request("long", prompts[5], SamplingParams(max_tokens=200, ignore_eos=True), data_parallel_rank=0)
    num_tokens = 0
    for _ in range(50):
        num_tokens = max([num_tokens, *(len(o.outputs[0].token_ids) for o in engine.step())])
        if num_tokens >= 3:
            break
    assert num_tokens >= 3
    held = engine_stats(dp_llm)[0]
    assert held["num_running_reqs"] == 1 and held["num_free_blocks"] < held["num_blocks"] - 1
    engine.abort_request(["long"])
    engine.check_idle_invariants()  # the abort reaches engine 0 before the check does
    freed = engine_stats(dp_llm)[0]
    assert freed["num_running_reqs"] == 0 and freed["num_free_blocks"] == freed["num_blocks"] - 1
    assert engine.engine_core.balancer.num_tracked_requests == 0
    # stale step outputs of the aborted request are dropped; the engines go on serving
    assert len(dp_llm.generate(prompts[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_async_engines_share_a_burst_and_one_death_fails_every_caller(make_async_llm):
    engine = make_async_llm(faults="step_delay_ms=10", data_parallel_size=2)
    client = engine.engine_core
    pids = [core.process.pid for core in client.engines]

    async def consume(i, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for output in engine.generate(f"x{i}", params, str(i)):
            last = output
        return len(last.outputs[0].token_ids)

    async def main():
        assert await asyncio.gather(*[consume(i, 4) for i in range(10)]) == [4] * 10
        await engine.check_idle_invariants()
        debug = await engine.get_debug_state()
        assert all(stats["num_steps"] > 0 for stats in debug["engine"]["engines"])
        tasks = [asyncio.create_task(consume(100 + i, 200)) for i in range(8)]
        await asyncio.sleep(0.5)
        kill(pids[1])
        started = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - started < 5
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await consume(99, 4)

    run(main(), timeout=90)
    assert wait_until_dead(pids[0]), "the surviving engine was not stopped"


def test_a_sync_caller_waiting_on_the_engines_gets_engine_dead_when_one_dies(llama_checkpoint, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "step_delay_ms=10")
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=256, data_parallel_size=2, multiprocess=True)
    try:
        pids = [core.process.pid for core in llm.llm_engine.engine_core.engines]
        killer = threading.Timer(0.5, kill, args=(pids[0],))
        killer.start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate([f"y{i}" for i in range(6)], SamplingParams(max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - started < 5.5
        with pytest.raises(EngineDeadError):
            llm.llm_engine.check_health()
        assert wait_until_dead(pids[1]), "the surviving engine was not stopped"
    finally:
        llm.shutdown()
