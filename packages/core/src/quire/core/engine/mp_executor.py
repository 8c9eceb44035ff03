"""``MultiprocExecutor``: tensor parallelism over worker processes.

```
 engine-core process                                    worker process (rank r = 1 … N-1)
 ┌──────────────────────────────────────┐   Pipe        ┌──────────────────────────────────┐
 │ EngineCore → MultiprocExecutor        │ ────────────► │ run_worker: ModelRunner(rank r)  │
 │   ModelRunner(rank 0)  ──► returns    │  one encoded  │   executes every step, returns   │
 │   the sampled tokens                  │  call a step  │   nothing                         │
 └──────────────────────────────────────┘               └──────────────────────────────────┘
            └───────────── gloo all-reduce / all-gather inside each forward ─────────────┘
```

The engine core computes rank 0 itself and sends each step's ``SchedulerOutput`` (encoded once) to the
other ranks; every rank samples the same tokens from the gathered logits, and rank 0's are returned. A
worker that dies makes the next call (or the collective it leaves hanging, which gloo fails as soon as
the dead rank's sockets close) raise ``EngineDeadError``; waits on workers are bounded and watch them.

``TensorParallelExecutor`` is that protocol whatever runs the workers; ``TensorParallelWorker`` is a rank's side
of it. ``MultiprocExecutor`` runs them in processes of this machine, ``RayExecutor`` (``ray_executor``) as
Ray actors.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import logging
import multiprocessing
import pickle
import time
from collections.abc import Iterable
from typing import Any

from quire.core.config import EngineConfig
from quire.core.distributed.group import LOOPBACK, TensorParallelGroup, connect_store, open_store
from quire.core.engine.executor import UniProcExecutor
from quire.core.errors import ConfigError, EngineDeadError
from quire.core.sched.output import ModelRunnerOutput, SchedulerOutput
from quire.core.timing import StepTimings
from quire.core.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Loading a model shard (and, first, importing torch) may take this long before a worker reports.
STARTUP_TIMEOUT_SECONDS = 600.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0
POLL_SECONDS = 0.05
READY = "ready"


class CallKind(enum.Enum):
    INITIALIZE_KV_CACHE = 1
    EXECUTE = 2
    REMOVE_REQUESTS = 3
    SHUTDOWN = 4


@dataclasses.dataclass
class WorkerCall:
    """What the engine core asks a worker to do; ``argument``: the KV block count, the ``SchedulerOutput`` or
    the request ids, by ``kind``."""

    kind: CallKind
    argument: Any = None


class TensorParallelWorker:
    """Rank ``rank`` (1 … N-1) of a tensor-parallel group, wherever it runs: ``__init__`` connects to rank 0's
    store, ``load()`` joins the group (once every rank has joined), builds this rank's runner and returns its KV
    block count, then ``handle`` runs the engine core's encoded calls one by one."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, store_host: str, store_port: int,
                 host: str = LOOPBACK):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.host = host  # where the other ranks reach this one
        self.store = connect_store(store_host, store_port, world_size)
        self.model_runner: ModelRunner | None = None

    def load(self) -> int:
        group = TensorParallelGroup.join(self.store, self.rank, self.world_size, self.host)
        self.model_runner = ModelRunner(self.config, group)
        return self.model_runner.num_kv_blocks()

    def handle(self, payload: bytes) -> bool:
        """Run one pickled ``WorkerCall``; False once it was SHUTDOWN."""
        call: WorkerCall = pickle.loads(payload)
        if call.kind is CallKind.EXECUTE:
            self.model_runner.execute(call.argument)
        elif call.kind is CallKind.REMOVE_REQUESTS:
            self.model_runner.remove_requests(call.argument)
        elif call.kind is CallKind.INITIALIZE_KV_CACHE:
            self.model_runner.initialize_kv_cache(call.argument)
        else:
            return False
        return True


def run_worker(config: EngineConfig, rank: int, world_size: int, store_port: int, connection) -> None:
    """A worker process's life: report that it started, load its shard and report its KV block count, then
    follow the engine core's calls until SHUTDOWN (or until the engine core's end of the pipe closes)."""
    worker = TensorParallelWorker(config, rank, world_size, LOOPBACK, store_port)
    connection.send(READY)
    connection.send(worker.load())
    while True:
        try:
            payload = connection.recv_bytes()
        except EOFError:
            return  # the engine core is gone
        if not worker.handle(payload):
            return


class TensorParallelExecutor(UniProcExecutor):
    """Rank 0 of ``config.parallel.tensor_parallel_size`` in this process, the other ranks in workers that a
    subclass starts, feeds and watches.

    Rank 0's runner answers the one-runner queries (``num_threads``, ``num_runner_rows``) as
    ``UniProcExecutor``'s does; ``__init__`` builds that runner itself, with its group. A subclass sets up its
    (empty) worker state before calling ``__init__``, which calls, in order: ``_place_ranks``,
    ``_start_workers``, ``_receive_num_blocks``; then every call is ``_send``; ``_stop_workers`` ends them
    (also when ``__init__`` fails part-way).
    """

    name = "tensor-parallel"

    def __init__(self, config: EngineConfig):
        world_size = config.parallel.tensor_parallel_size
        if world_size < 2:
            raise ConfigError(f"the {self.name} executor splits a model over tensor_parallel_size >= 2 ranks, "
                              f"got {world_size}")
        self.is_shut_down = False
        try:
            hosts = self._place_ranks(config)
            store = open_store(world_size, hosts[0])
            self._start_workers(config, hosts, store.port)
            group = TensorParallelGroup.join(store, 0, world_size, hosts[0])
            self.model_runner = ModelRunner(config, group)
            self.worker_num_blocks = self._receive_num_blocks()
        except BaseException:
            self.shutdown()
            raise
        self.store = store  # NOTE: rank 0 serves the store the workers met at; it lives as long as they do

    def num_kv_blocks(self) -> int:
        return min([self.model_runner.num_kv_blocks(), *self.worker_num_blocks])

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._send(WorkerCall(CallKind.INITIALIZE_KV_CACHE, num_blocks))
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      timings: StepTimings | None = None) -> ModelRunnerOutput:
        self._send(WorkerCall(CallKind.EXECUTE, scheduler_output))
        try:
            return self.model_runner.execute(scheduler_output, timings)
        except RuntimeError as error:  # a collective fails when a rank is gone
            self._check_workers()
            raise EngineDeadError(f"tensor-parallel step failed: {error}") from error

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        if request_ids:
            self._send(WorkerCall(CallKind.REMOVE_REQUESTS, request_ids))
            self.model_runner.remove_requests(request_ids)

    def shutdown(self) -> None:
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self._stop_workers()

    def _send(self, call: WorkerCall) -> None:
        """The same call to every worker, encoded once."""
        self._check_workers()
        self._send_payload(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))

    @abc.abstractmethod
    def _place_ranks(self, config: EngineConfig) -> list[str]:
        """Each rank's address (rank 0's first): 127.0.0.1 for all while every rank is on this machine."""

    @abc.abstractmethod
    def _start_workers(self, config: EngineConfig, hosts: list[str], store_port: int) -> None:
        """Start a ``TensorParallelWorker`` for each rank 1 … N-1 and return once each is connected to the
        store at ``hosts[0]``:``store_port``, loading (joining the group waits for rank 0)."""

    @abc.abstractmethod
    def _receive_num_blocks(self) -> list[int]:
        """Each worker's KV block count, once it has loaded (bounded wait; EngineDeadError if it is gone)."""

    @abc.abstractmethod
    def _send_payload(self, payload: bytes) -> None:
        """Hand an encoded call to every worker, in order, without waiting for it to run."""

    @abc.abstractmethod
    def _check_workers(self) -> None:
        """Raise EngineDeadError naming a worker known to be gone; cheap (called before every call)."""

    @abc.abstractmethod
    def _stop_workers(self) -> None:
        """Stop every worker started so far and release what holds them; never raises for one already gone."""


@dataclasses.dataclass
class WorkerHandle:
    rank: int
    process: multiprocessing.process.BaseProcess
    connection: Any  # the engine core's end of the pipe


class MultiprocExecutor(TensorParallelExecutor):
    """Ranks 1 … N-1 in spawned processes of this machine, fed over pipes; ranks meet on 127.0.0.1."""

    name = "mp"

    def __init__(self, config: EngineConfig):
        self.workers: list[WorkerHandle] = []
        super().__init__(config)

    def _place_ranks(self, config: EngineConfig) -> list[str]:
        return [LOOPBACK] * config.parallel.tensor_parallel_size

    def _start_workers(self, config: EngineConfig, hosts: list[str], store_port: int) -> None:
        context = multiprocessing.get_context("spawn")  # NOTE: forking a process with torch's threads running hangs
        world_size = config.parallel.tensor_parallel_size
        for rank in range(1, world_size):
            connection, worker_end = context.Pipe()
            process = context.Process(target=run_worker, args=(config, rank, world_size, store_port, worker_end),
                                      name=f"quire-tp-rank-{rank}", daemon=True)
            process.start()
            worker_end.close()
            self.workers.append(WorkerHandle(rank, process, connection))
        for worker in self.workers:  # NOTE: joining waits for every rank, so first make sure each started
            self._receive(worker, STARTUP_TIMEOUT_SECONDS)

    def _receive_num_blocks(self) -> list[int]:
        return [self._receive(worker, STARTUP_TIMEOUT_SECONDS) for worker in self.workers]

    def _send_payload(self, payload: bytes) -> None:
        for worker in self.workers:
            try:
                worker.connection.send_bytes(payload)
            except OSError as error:
                raise EngineDeadError(f"tensor-parallel rank {worker.rank} is gone: {error}") from error

    def _check_workers(self) -> None:
        for worker in self.workers:
            if not worker.process.is_alive():
                raise EngineDeadError(f"tensor-parallel rank {worker.rank} exited (code {worker.process.exitcode})")

    def _stop_workers(self) -> None:
        for worker in self.workers:
            try:
                worker.connection.send_bytes(pickle.dumps(WorkerCall(CallKind.SHUTDOWN)))
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_SECONDS
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(SHUTDOWN_TIMEOUT_SECONDS)
            worker.connection.close()

    def _receive(self, worker: WorkerHandle, timeout: float):
        """The worker's next reply, waiting at most ``timeout`` seconds and no longer than it lives."""
        deadline = time.monotonic() + timeout
        while not worker.connection.poll(POLL_SECONDS):
            if not worker.process.is_alive():
                raise EngineDeadError(f"tensor-parallel rank {worker.rank} exited (code {worker.process.exitcode}) "
                                      "while starting")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel rank {worker.rank} did not start within {timeout:.0f} s")
        return worker.connection.recv()
