"""Admission limits answer 503 with Retry-After at once; accepted requests complete."""

import asyncio

import httpx

from tests.servers import ServerProcess


def test_a_burst_of_20_against_a_limit_of_4():
    server = ServerProcess("--max-num-queued-reqs", "4", env={"QUIRE_TEST_FAULTS": "step_delay_ms=20"})
    try:
        async def one(http, i):
            return await http.post(server.url("/v1/completions"),
                                   json={"prompt": f"item {i}", "max_tokens": 10, "ignore_eos": True})

        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(*[one(http, i) for i in range(20)])

        responses = asyncio.run(asyncio.wait_for(burst(), 60))
        refused = [r for r in responses if r.status_code == 503]
        accepted = [r for r in responses if r.status_code == 200]
        assert len(refused) >= 16 and len(refused) + len(accepted) == 20
        for response in refused:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "server_overloaded"
            assert response.elapsed.total_seconds() < 2  # immediate, not after queueing
        for response in accepted:
            assert response.json()["usage"]["completion_tokens"] == 10
    finally:
        assert server.stop() == 0
