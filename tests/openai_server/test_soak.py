"""A bounded soak: mixed traffic at about 70% of measured capacity for 10 minutes (``-m slow``).

Streams, streams aborted midway, malformed requests, long prompts and plain requests arrive at random
(Poisson) times. Passes with no 5xx, flat memory in both processes, time to first token that has not
drifted by 20% between the first and last minute, and nothing left behind. ``QUIRE_SOAK_SECONDS``
shortens it for a trial run.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time

import httpx
import pytest

from tests.openai_server.test_abort_storm import BOUNDED_KERNEL_CACHES, process_usage
from tests.openai_server.test_reliability import wait_idle
from tests.servers import ServerProcess

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

SOAK_SECONDS = float(os.environ.get("QUIRE_SOAK_SECONDS", 600))
LOAD_FRACTION = 0.7
MAX_RSS_GROWTH_MB = 128
MAX_TTFT_DRIFT = 0.2
LONG_PROMPT = "Return the canonical string representation of the object. " * 60  # ~600 tokens


class Record:
    def __init__(self):
        self.statuses: dict[int, int] = {}
        self.ttfts: list[tuple[float, float]] = []  # (time since start, seconds)
        self.kinds: dict[str, int] = {}

    def status(self, code: int) -> None:
        self.statuses[code] = self.statuses.get(code, 0) + 1


async def streamed(client, body, record, start, abort_after=None):
    sent = time.monotonic()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        record.status(response.status_code)
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                if seen == 0 and abort_after is None:
                    record.ttfts.append((sent - start, time.monotonic() - sent))
                seen += 1
                if abort_after is not None and seen >= abort_after:
                    return


async def one(client, rng, record, start, index):
    kind = rng.choices(["stream", "abort", "malformed", "long", "plain"], [0.55, 0.15, 0.1, 0.1, 0.1])[0]
    record.kinds[kind] = record.kinds.get(kind, 0) + 1
    body = {"prompt": f"{index}: The json module", "max_tokens": rng.randint(16, 64), "ignore_eos": True}
    if kind == "stream":
        await streamed(client, body, record, start)
    elif kind == "abort":
        await streamed(client, body, record, start, abort_after=rng.randint(1, 8))
    elif kind == "malformed":
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -rng.randint(1, 9)})
        record.status(response.status_code)
        assert response.status_code == 400
    elif kind == "long":
        response = await client.post("/v1/completions", json={**body, "prompt": LONG_PROMPT + str(index)})
        record.status(response.status_code)
    else:
        response = await client.post("/v1/completions", json=body)
        record.status(response.status_code)


async def measure_capacity(base_url: str) -> float:
    """Requests per second that 16 closed-loop clients of the same mix complete (20 s)."""
    rng, record, done = random.Random(0), Record(), 0
    deadline = time.monotonic() + 20

    async def client_loop(client):
        nonlocal done
        while time.monotonic() < deadline:
            await one(client, rng, record, time.monotonic(), done)
            done += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(16)))
    return done / 20


async def soak(base_url: str, rate: float, seconds: float, pids, record: Record, memory: list):
    rng = random.Random(1)
    start = time.monotonic()
    tasks = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=512)) as client:
        next_sample, index = start, 0
        while (now := time.monotonic()) - start < seconds:
            if now >= next_sample:
                memory.append((now - start, {pid: process_usage(pid)[0] for pid in pids}))
                next_sample += 30
            tasks.append(asyncio.ensure_future(one(client, rng, record, start, index)))
            index += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    memory.append((time.monotonic() - start, {pid: process_usage(pid)[0] for pid in pids}))


def test_bounded_soak():
    server = ServerProcess("--enable-debug-routes", "--max-num-seqs", "64", env=BOUNDED_KERNEL_CACHES)
    try:
        pids = (server.process.pid, server.engine_pid())
        capacity = asyncio.run(measure_capacity(server.base_url))
        wait_idle(server, seconds=60)
        record, memory = Record(), []
        asyncio.run(soak(server.base_url, LOAD_FRACTION * capacity, SOAK_SECONDS, pids, record, memory))
        wait_idle(server, seconds=60)
        minute = min(60.0, SOAK_SECONDS / 4)
        first = [t for at, t in record.ttfts if at < minute]
        last = [t for at, t in record.ttfts if at >= SOAK_SECONDS - minute]
        drift = statistics.median(last) / statistics.median(first) - 1
        all_ttfts = sorted(t for _, t in record.ttfts)
        growth = {pid: memory[-1][1][pid] - memory[1][1][pid] for pid in pids}  # after the first sample
        print(f"\nsoak {SOAK_SECONDS:.0f} s at {LOAD_FRACTION:.0%} of {capacity:.2f} req/s: "
              f"{sum(record.kinds.values())} requests {record.kinds}, statuses {record.statuses}; "
              f"TTFT p50 {statistics.median(all_ttfts) * 1e3:.0f} ms, "
              f"p99 {all_ttfts[int(0.99 * (len(all_ttfts) - 1))] * 1e3:.0f} ms, first-minute median "
              f"{statistics.median(first) * 1e3:.0f} ms, last-minute {statistics.median(last) * 1e3:.0f} ms "
              f"(drift {drift:+.0%}); RSS growth MB {growth}")
        assert not any(code >= 500 for code in record.statuses), record.statuses
        assert drift < MAX_TTFT_DRIFT
        assert all(mb < MAX_RSS_GROWTH_MB for mb in growth.values()), growth
    finally:
        server.stop()
