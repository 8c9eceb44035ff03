"""Two engine cores behind the real server (``--data-parallel-size 2``): the load split read from
``/metrics``, greedy outputs equal to one engine's, a pinned request aborted by its client, and the death
of one engine ending every open request and the server."""

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.openai_server.test_shutdown import start_streams
from tests.servers import ServerProcess, child_pids

# The demo server's settings (tests/conftest.py), so that greedy outputs can be compared with it.
DP_ARGS = ("--dtype", "float32", "--enable-debug-routes", "--max-num-seqs", "64", "--data-parallel-size", "2")
# every request outlives the burst (24 steps of at least 40 ms), so that each request finds the others in flight
SLOW = {"QUIRE_TEST_FAULTS": "step_delay_ms=40"}
NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def dp_server():
    server = ServerProcess(*DP_ARGS, env=SLOW)
    yield server
    server.stop()


def per_engine(server, name: str) -> dict[str, float]:
    """A metric's value per ``engine`` label, summed over its other labels."""
    response = httpx.get(server.url("/metrics"), timeout=10)
    assert response.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels["engine"]] = values.get(sample.labels["engine"], 0) + sample.value
    return values


def engine_pids(server) -> list[int]:
    """The server's engine-core processes (the children started with the IPC addresses)."""
    return [pid for pid in child_pids(server.process.pid)
            if any("ipc://" in part for part in Path(f"/proc/{pid}/cmdline").read_text().split("\0"))]


def completions(server, prompts: list[str]) -> list[str]:
    """Greedy completions of every prompt, all sent at once."""
    async def one(http, prompt):
        response = await http.post(server.url("/v1/completions"), json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*[one(http, prompt) for prompt in prompts])

    return asyncio.run(asyncio.wait_for(main(), 60))


def wait_for(condition, seconds: float = 10, interval: float = 0.05):
    """Poll ``condition`` until it returns something true (bounded); return its last value."""
    deadline = time.monotonic() + seconds
    while True:
        result = condition()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval)


def test_forty_requests_split_evenly_and_match_one_engine(dp_server, demo_server):
    prompts = [f"Request {i}: the json module" for i in range(NUM_REQUESTS)]
    before = per_engine(dp_server, "quire:request_success_total")
    texts = completions(dp_server, prompts)
    served = per_engine(dp_server, "quire:request_success_total")
    counts = [served.get(engine, 0) - before.get(engine, 0) for engine in ("0", "1")]
    assert sum(counts) == NUM_REQUESTS
    assert all(abs(count - NUM_REQUESTS / 2) <= NUM_REQUESTS / 2 * 0.1 for count in counts), counts
    assert texts == completions(demo_server, prompts)
    assert per_engine(dp_server, "quire:num_requests_running") == {"0": 0, "1": 0}


def test_a_pinned_stream_runs_on_its_engine_and_a_disconnect_frees_its_blocks(dp_server):
    body = {"prompt": "The json module", "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"X-data-parallel-rank": "1"}
    with httpx.stream("POST", dp_server.url("/v1/completions"), json=body, headers=headers,
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # NOTE: kept open: closing the iterator closes the connection
        num_events = 0
        while num_events < 10:  # a few tokens: the request then holds blocks on engine 1
            num_events += next(lines).startswith("data: {")
        usage = per_engine(dp_server, "quire:kv_cache_usage_perc")
        assert usage["1"] > 0 and usage["0"] == 0, usage
        assert per_engine(dp_server, "quire:num_requests_running")["1"] == 1
    # leaving the block closed the connection: the abort reaches engine 1, which reports its blocks free
    freed = wait_for(lambda: per_engine(dp_server, "quire:kv_cache_usage_perc") == {"0": 0, "1": 0})
    assert freed, per_engine(dp_server, "quire:kv_cache_usage_perc")
    assert per_engine(dp_server, "quire:num_requests_running") == {"0": 0, "1": 0}
    idle = wait_for(lambda: httpx.post(dp_server.url("/debug/check_idle"), timeout=10).status_code == 200)
    assert idle, httpx.post(dp_server.url("/debug/check_idle"), timeout=10).text
    engines = httpx.get(dp_server.url("/debug/state"), timeout=10).json()["engine"]["engines"]
    assert [e["num_free_blocks"] for e in engines] == [e["num_blocks"] - 1 for e in engines]


@pytest.mark.parametrize("rank", ["2", "-1", "one"])
def test_a_bad_rank_header_is_a_400_naming_it(dp_server, rank):
    response = httpx.post(dp_server.url("/v1/chat/completions"), headers={"X-data-parallel-rank": rank},
                          timeout=10, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "X-data-parallel-rank" and "X-data-parallel-rank" in error["message"]


def test_killing_one_engine_fails_every_open_request_and_stops_the_server():
    server = ServerProcess("--enable-debug-routes", "--data-parallel-size", "2",
                           env={"QUIRE_TEST_FAULTS": "step_delay_ms=20"})
    try:
        pids = engine_pids(server)
        assert len(pids) == 2, pids
        results, threads = start_streams(server, 6, max_tokens=400)
        running = wait_for(lambda: all(value >= 1 for value in per_engine(
            server, "quire:num_requests_running").values()) and len(results) == 0, seconds=20)
        assert running, per_engine(server, "quire:num_requests_running")
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(timeout=10)
        assert time.monotonic() - killed < 5, "open requests took more than 5 s to fail"
        assert results == {i: ("error", "engine_dead") for i in range(6)}, results
        try:
            assert httpx.get(server.url("/health"), timeout=5).status_code == 503
        except httpx.ConnectError:
            pass  # already gone: also fine
        assert server.process.wait(timeout=10) != 0
        assert time.monotonic() - killed < 10
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "an engine outlived the server"
    finally:
        server.stop()


def test_single_engine_series_carry_engine_zero(demo_server):
    """One engine: every series is labelled ``engine="0"`` and no other engine appears."""
    response = httpx.get(demo_server.url("/metrics"), timeout=10)
    engines = {sample.labels.get("engine") for family in text_string_to_metric_families(response.text)
               for sample in family.samples if sample.name.startswith("quire:")}
    assert engines == {"0"}, engines
    assert httpx.get(demo_server.url("/health"), timeout=10).json() == {"status": "ok"}
