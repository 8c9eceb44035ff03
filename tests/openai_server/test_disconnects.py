"""Clients that go away: streaming and non-streaming disconnects abort their requests in the engine."""

import asyncio
import json
import random
import time

import httpx

from tests.servers import ServerProcess


def wait_idle(server, seconds=10):
    """Poll the debug route until nothing is left in the engine or the front end (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        response = httpx.post(server.url("/debug/check_idle"), timeout=10)
        if response.status_code == 200 or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_half_of_32_streaming_clients_disconnect(demo_server):
    rng = random.Random(7)
    leavers = set(rng.sample(range(32), 16))
    leave_after = {i: rng.randint(1, 30) for i in leavers}
    body = {"prompt": "The json module", "max_tokens": 48, "temperature": 0.8, "ignore_eos": True, "stream": True}

    async def client(i, http):
        tokens = 0
        async with http.stream("POST", demo_server.url("/v1/completions"), json={**body, "seed": i}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens += 1
                if i in leavers and tokens >= leave_after[i]:
                    return None  # leaving the block closes the connection mid-stream
            return chunk["choices"][0]["finish_reason"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*[client(i, http) for i in range(32)])

    results = asyncio.run(asyncio.wait_for(main(), 120))
    for i, finish_reason in enumerate(results):
        assert (finish_reason is None) == (i in leavers)
        if i not in leavers:
            assert finish_reason == "length"
    response = wait_idle(demo_server)
    assert response.status_code == 200, response.text


def test_a_non_streaming_client_that_times_out_is_aborted():
    server = ServerProcess("--dtype", "float32", "--enable-debug-routes", env={"QUIRE_TEST_FAULTS": "step_delay_ms=30"})
    try:
        try:
            httpx.post(server.url("/v1/completions"), timeout=0.5,
                       json={"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("200 tokens at 30 ms a step cannot finish in half a second")
        # the request would need ~6 s more; it is aborted well before that
        response = wait_idle(server, seconds=3)
        assert response.status_code == 200, response.text
        state = httpx.get(server.url("/debug/state"), timeout=10).json()
        assert state["engine"]["num_running_reqs"] == 0 and state["front_end"]["tracked_requests"] == 0
        # the aborted request ran some 30 ms steps (about half a second of them) before it was dropped
        timings = httpx.get(server.url("/debug/step_timings"), params={"reset": "true"}, timeout=10).json()
        assert 5 <= timings["num_steps"] < 200 and timings["forward"] > 0, timings
        assert httpx.get(server.url("/debug/step_timings"), timeout=10).json()["num_steps"] == 0
    finally:
        assert server.stop() == 0
