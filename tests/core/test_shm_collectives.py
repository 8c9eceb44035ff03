"""Shared-memory collectives of the ranks on one machine (``quire.core.distributed.shm``): the same sums and
concatenations as summing in rank order, on every rank, through both sets of slots and gloo's fallback for
large tensors; a rank that dies fails its peers' wait at once; nothing is left in /dev/shm."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from quire.core.distributed import shm
from quire.core.distributed.group import LOOPBACK, TensorParallelGroup, connect_store, open_store

WORLD_SIZE = 3  # more than two: the sums past the first pair
NUM_ROUNDS = 60
LARGE = shm.SLOT_BYTES // 4 + 1  # float32 elements: one more than a slot holds

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")


def contribution(rank: int, round_index: int, dtype: torch.dtype, shape=(3, 64)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * round_index + rank)
    return torch.randn(shape, generator=generator).to(dtype)


def expected_sum(round_index: int, dtype: torch.dtype, shape=(3, 64)) -> torch.Tensor:
    total = contribution(0, round_index, dtype, shape) + contribution(1, round_index, dtype, shape)
    for rank in range(2, WORLD_SIZE):
        total += contribution(rank, round_index, dtype, shape)
    return total


def run_rank(port: int, rank: int, results) -> None:
    """One rank: every round's all-reduce and all-gather, checked against the rank-order sums."""
    torch.set_num_threads(1)
    store = connect_store(LOOPBACK, port, WORLD_SIZE)
    group = TensorParallelGroup.join(store, rank, WORLD_SIZE)
    results.put((rank, check_rounds(group)))


def check_rounds(group: TensorParallelGroup) -> list[str]:
    failures = []
    assert group.shared_memory is not None
    for round_index in range(NUM_ROUNDS):
        dtype = (torch.float32, torch.bfloat16)[round_index % 2]
        reduced = group.all_reduce(contribution(group.rank, round_index, dtype))
        if not torch.equal(reduced, expected_sum(round_index, dtype)):
            failures.append(f"all_reduce round {round_index}")
        gathered = group.all_gather(torch.full((2, 1 + round_index % 3), float(group.rank)))
        expected = torch.cat([torch.full((2, 1 + round_index % 3), float(r)) for r in range(WORLD_SIZE)], dim=-1)
        if not torch.equal(gathered, expected):
            failures.append(f"all_gather round {round_index}")
    large = group.all_reduce(contribution(group.rank, 0, torch.float32, (LARGE,)))  # through gloo
    if not torch.allclose(large, expected_sum(0, torch.float32, (LARGE,)), atol=1e-5):
        failures.append("all_reduce larger than a slot")
    return failures


def leftover_segments() -> list[str]:
    return sorted(path.name for path in shm.SHM_FOLDER.glob("quire-tp-*"))


def test_every_rank_gets_the_rank_order_results():
    before = leftover_segments()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = open_store(WORLD_SIZE)
    workers = [context.Process(target=run_rank, args=(store.port, rank, results), daemon=True)
               for rank in range(1, WORLD_SIZE)]
    for worker in workers:
        worker.start()
    group = TensorParallelGroup.join(store, 0, WORLD_SIZE)
    assert check_rounds(group) == []
    assert sorted(results.get(timeout=60) for _ in workers) == [(rank, []) for rank in range(1, WORLD_SIZE)]
    for worker in workers:
        worker.join(timeout=10)
    assert leftover_segments() == before  # the segment's name went once every rank had mapped it


def die_after_joining(port: int) -> None:
    store = connect_store(LOOPBACK, port, 2)
    TensorParallelGroup.join(store, 1, 2)
    os._exit(3)


def test_a_dead_rank_fails_the_wait_promptly():
    context = multiprocessing.get_context("spawn")
    store = open_store(2)
    worker = context.Process(target=die_after_joining, args=(store.port,), daemon=True)
    worker.start()
    group = TensorParallelGroup.join(store, 0, 2)
    worker.join(timeout=30)  # NOTE: reaped, and even a zombie would count as dead
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {worker.pid}\\) is gone"):
        group.all_reduce(torch.ones(4))
    assert time.monotonic() - started < 2
    assert not Path(f"/proc/{worker.pid}").exists() or worker.exitcode == 3
