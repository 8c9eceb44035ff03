"""``TensorParallelGroup``: the ranks that compute one model together, and their collectives.

A group is an object handed to whatever needs it (the model's parallel layers, the worker that builds them);
nothing is registered in a module global, so one process may hold several groups (a test's engines) and a
one-rank group makes every collective a no-op. Ranks meet through a ``TCPStore`` that rank 0 serves
(``open_store``) and exchange tensors over gloo (CPU tensors), on 127.0.0.1 when every rank is on one machine
and on each machine's own address otherwise (the Ray executor across nodes). Ranks of one machine exchange
the tensors that fit its slots through shared memory instead (``shm``: microseconds where gloo's loopback
takes a millisecond), gloo carrying the rest.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from quire.core.distributed import shm

LOOPBACK = "127.0.0.1"
# How long a rank waits for the others to start or to join a collective before it raises: a rank that
# died closes its sockets and fails its peers at once; this bounds a rank that hangs.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


class TensorParallelGroup:
    """``rank`` of ``world_size`` processes splitting one model; collectives run over ``process_group``.

    ``TensorParallelGroup()`` is the one-rank group: ``all_reduce`` and ``all_gather`` return their input.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, process_group=None, shared_memory=None):
        if world_size > 1 and process_group is None:
            raise ValueError("a group of several ranks needs a process group")
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.shared_memory = shared_memory  # a SharedMemoryCollectives when every rank is on this machine

    @classmethod
    def join(cls, store: dist.Store, rank: int, world_size: int, host: str = LOOPBACK,
             timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> TensorParallelGroup:
        """Join the gloo group whose ranks meet at ``store`` (returns once every rank has joined); the other
        ranks reach this one at ``host``, this machine's address."""
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        process_group = dist.ProcessGroupGloo(store, rank, world_size, options)
        shared_memory = None
        if host == LOOPBACK and shm.available():
            shared_memory = shm.SharedMemoryCollectives(store, rank, world_size, timeout.total_seconds())
        return cls(rank, world_size, process_group, shared_memory)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            if self.shared_memory is not None and self.shared_memory.fits(tensor) and tensor.is_contiguous():
                return self.shared_memory.all_reduce(tensor)
            self.process_group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dimension, in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.shared_memory is not None and self.shared_memory.fits(tensor):
            return self.shared_memory.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.process_group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)


def open_store(world_size: int, host: str = LOOPBACK,
               timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """Rank 0's store, on a free port (``store.port``) of ``host`` (rank 0's address) that the other ranks
    ``connect_store`` to."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def connect_store(host: str, port: int, world_size: int,
                  timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def shard_range(full_size: int, local_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ``[start, stop)`` of a dimension of ``full_size`` that ``rank`` holds ``local_size`` of.

    Each rank holds its own consecutive slice (the last ones may be short or empty, e.g. a vocabulary that
    does not divide evenly), except where the dimension has fewer whole slices than there are ranks (KV
    heads fewer than ranks): then ranks share slices, neighbours holding the same one.
    """
    num_slices, remainder = divmod(full_size, local_size)
    index = rank * num_slices // world_size if remainder == 0 and num_slices < world_size else rank
    start = min(index * local_size, full_size)
    return start, min(start + local_size, full_size)
