"""1,000 requests aborted in every way a client can abort; afterwards nothing is left behind."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from tests.openai_server.test_reliability import assert_idle, wait_idle
from tests.servers import ServerProcess

pytestmark = pytest.mark.reliability

NUM_REQUESTS = 1000
NUM_ROUNDS = 5
CONCURRENCY = 32
MAX_RSS_GROWTH_MB = 64  # per process, between the first round and the last
# NOTE: oneDNN and ideep keep a kernel per new matrix shape (up to 1,024 each, their default), and every
# step's token count is a new shape, so with the defaults the engine's memory grows for thousands of
# requests before it levels off (540 -> 999 MB over 4,000 aborts here). Small caches leave only what a
# leak would add.
BOUNDED_KERNEL_CACHES = {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}
MAX_FD_GROWTH = 8
SHARED_PREFIX = "The os module provides a portable way of using operating system dependent functionality. " * 4


def process_usage(pid: int) -> tuple[float, int]:
    """(resident MB, open file descriptors)."""
    with open(f"/proc/{pid}/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def one_abort(client: httpx.AsyncClient, kind: str, index: int) -> str:
    prompt = SHARED_PREFIX + f"variant {index}" if index % 2 else f"request {index}: import sys"
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True}
    if kind == "n3":
        body["n"] = 3
    if kind in ("mid_stream", "n3"):
        body["stream"] = True
        async with client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream
        return kind
    timeout = 0.005 if kind == "before_first_byte" else 0.3
    try:
        await client.post("/v1/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        pass
    return kind


async def storm(base_url: str, count: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    kinds = ["before_first_byte", "mid_stream", "client_timeout", "n3"]
    semaphore = asyncio.Semaphore(CONCURRENCY)
    tally: dict[str, int] = {}

    async def run(index: int, client: httpx.AsyncClient) -> None:
        async with semaphore:
            kind = await one_abort(client, rng.choice(kinds), index)
            tally[kind] = tally.get(kind, 0) + 1

    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(run(i, client) for i in range(count))), timeout=600)
    return tally


def test_a_thousand_aborts_leave_nothing_behind():
    """Five rounds of 200 aborts. Memory and descriptors are compared between the end of the first round
    (allocator pools and caches warm) and the end of the last: a leak grows every round."""
    server = ServerProcess("--enable-debug-routes", "--max-num-seqs", "64", env=BOUNDED_KERNEL_CACHES)
    try:
        pids = (server.process.pid, server.engine_pid())
        baseline = httpx.get(server.url("/debug/state"), timeout=10).json()["engine"]["num_free_blocks"]
        started, tally, usage = time.monotonic(), {}, []
        for round_number in range(NUM_ROUNDS):
            counts = asyncio.run(storm(server.base_url, NUM_REQUESTS // NUM_ROUNDS, seed=round_number))
            for kind, count in counts.items():
                tally[kind] = tally.get(kind, 0) + count
            wait_idle(server, seconds=30)
            usage.append({pid: process_usage(pid) for pid in pids})
        state = httpx.get(server.url("/debug/state"), timeout=10).json()
        print(f"\n{sum(tally.values())} aborted requests {tally} in {time.monotonic() - started:.0f} s; free blocks "
              f"{baseline} before and {state['engine']['num_free_blocks']} after; per round (RSS MB, fds): "
              + "; ".join(f"pid {pid}: " + " ".join(f"({u[pid][0]:.0f}, {u[pid][1]})" for u in usage) for pid in pids))
        assert sum(tally.values()) == NUM_REQUESTS and len(tally) == 4
        assert state["engine"]["num_free_blocks"] == baseline
        assert_idle(server)
        for pid in pids:
            (rss0, fds0), (rss1, fds1) = usage[0][pid], usage[-1][pid]
            assert rss1 - rss0 < MAX_RSS_GROWTH_MB, f"process {pid} grew by {rss1 - rss0:.0f} MB"
            assert fds1 - fds0 <= MAX_FD_GROWTH, f"process {pid} holds {fds1 - fds0} more descriptors"
        assert httpx.post(server.url("/v1/completions"), timeout=30,
                          json={"prompt": "import os", "max_tokens": 4}).status_code == 200
    finally:
        server.stop()
