"""Several engine-core processes behind one engine-core client: data parallelism.

``DPSyncClient`` (for ``LLMEngine``) and ``DPAsyncClient`` (for ``AsyncLLM``) start one ``SyncMPClient`` /
``AsyncMPClient`` per data-parallel rank, each engine with its own scheduler and KV cache, all filling one
output queue. A new request goes to the engine the ``DataParallelBalancer`` picks (or the one it is pinned
to); an abort goes to the engines holding the requests; outputs come from whichever engine produced them
(``EngineCoreOutputs.engine_index`` says which), with the engine's own scheduler statistics and, beside
them, the group's combined ones (``group_scheduler_stats``). A utility call runs on every engine and the
answers are combined (``dp_combine``).

If any engine dies, the group is dead: the others are stopped and every waiting caller gets
``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from quire.core.config import EngineConfig
from quire.core.engine.core_client import AsyncOnlyClient, EngineCoreClient
from quire.core.engine.dp_balancer import DataParallelBalancer
from quire.core.engine.dp_combine import combine_scheduler_stats, combine_utility_results
from quire.core.engine.mp_client import AsyncMPClient, MPClient, SyncMPClient
from quire.core.errors import EngineDeadError, EngineUtilityError
from quire.core.wire import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)


def start_engines(config: EngineConfig, make_client: Callable[..., MPClient]) -> list[MPClient]:
    """One client (and engine core) per data-parallel rank, started at the same time: ranks below
    ``num_local_engines`` as child processes, the others through headless launchers that register at the
    front end's RPC port, or all as Ray actors (``remote_engines``). If any fails to start, the others are
    shut down and its error is raised."""
    from quire.core.engine import remote_engines

    parallel = config.parallel
    size, num_local = parallel.data_parallel_size, parallel.num_local_engines
    registrar = None
    if parallel.data_parallel_backend == "ray":
        launchers = [remote_engines.RayEngineLauncher()] * size
    else:
        if num_local < size:
            registrar = remote_engines.EngineRegistrar(parallel.data_parallel_address,
                                                       parallel.data_parallel_rpc_port, list(range(num_local, size)),
                                                       size)
        launchers = [None if rank < num_local else
                     remote_engines.HeadlessEngineLauncher(registrar, parallel.data_parallel_address)
                     for rank in range(size)]
    try:
        with ThreadPoolExecutor(size, thread_name_prefix="engine-start") as pool:
            futures = [pool.submit(make_client, config.for_data_parallel_rank(rank), launcher=launchers[rank])
                       for rank in range(size)]
    finally:
        if registrar is not None:
            registrar.close()
    clients = [future.result() for future in futures if future.exception() is None]
    errors = [future.exception() for future in futures if future.exception() is not None]
    if errors:
        for client in clients:
            client.shutdown()
        raise errors[0]
    return clients


class _DataParallelGroup(EngineCoreClient):
    """What both clients share: starting the engines, routing, combining, and the group's death."""

    def __init__(self, config: EngineConfig, make_client: Callable[..., MPClient], outputs):
        self._outputs = outputs
        self._dead_rank: int | None = None
        self._death_lock = threading.Lock()
        self.engines: list[MPClient] = []
        self.engines = start_engines(config, lambda rank_config, launcher: make_client(
            rank_config, outputs=outputs, on_dead=self._engine_died, launcher=launcher))
        self.balancer = DataParallelBalancer(len(self.engines))
        self.num_blocks = sum(engine.num_blocks for engine in self.engines)
        self.max_model_len = min(engine.max_model_len for engine in self.engines)
        self.block_size = self.engines[0].block_size
        self._latest_stats: list[SchedulerStats | None] = [None] * len(self.engines)
        if self.engine_dead:  # an engine died while the others were starting
            self.shutdown()
            raise self.dead_error

    @property
    def engine_dead(self) -> bool:
        return self._dead_rank is not None or any(engine.engine_dead for engine in self.engines)

    @property
    def dead_error(self) -> EngineDeadError:
        known = self._dead_rank is not None and self._dead_rank >= 0
        who = f"engine core {self._dead_rank}" if known else "an engine core"
        return EngineDeadError(f"{who} of the data-parallel group died (the others were stopped); no more "
                               "requests can be served")

    def ensure_alive(self) -> None:
        if self.engine_dead:
            raise self.dead_error

    def _engine_died(self, client: MPClient) -> None:
        """Called (from a monitor or reader thread, or the event loop) when an engine dies: stop the rest."""
        with self._death_lock:
            if self._dead_rank is not None:
                return
            self._dead_rank = self.engines.index(client) if client in self.engines else -1
        logger.error("data-parallel engine core %s died; stopping the others", self._dead_rank)
        for engine in self.engines:
            if engine is not client:
                engine.fail_and_stop()

    def _route(self, request: EngineCoreRequest) -> MPClient:
        self.ensure_alive()
        return self.engines[self.balancer.choose(request.request_id, request.data_parallel_rank)]

    def _received(self, item) -> EngineCoreOutputs:
        """Account for one item of the output queue; an engine's death is raised as the group's."""
        if isinstance(item, BaseException):
            raise self.dead_error
        self.balancer.record_outputs(item)
        if item.scheduler_stats is not None:
            self._latest_stats[item.engine_index] = item.scheduler_stats
            item.group_scheduler_stats = combine_scheduler_stats(
                self._latest_stats, item.scheduler_stats, [engine.num_blocks for engine in self.engines])
        return item

    def _combine(self, method: str, outcomes: list) -> object:
        """Every engine's answer (or error) to a utility call as one answer; failures name their engine."""
        if self.engine_dead or any(isinstance(outcome, EngineDeadError) for outcome in outcomes):
            raise self.dead_error
        failures = [f"engine core {rank}: {outcome}" for rank, outcome in enumerate(outcomes)
                    if isinstance(outcome, BaseException)]
        if failures:
            raise EngineUtilityError("; ".join(failures))
        return combine_utility_results(method, outcomes)

    def shutdown(self) -> None:
        for engine in self.engines:  # signal every engine core first, so that they stop together
            engine.stop_engine()
        for engine in self.engines:
            engine.shutdown()


class DPSyncClient(_DataParallelGroup):
    """Blocking data-parallel client for ``LLMEngine``."""

    def __init__(self, config: EngineConfig):
        super().__init__(config, SyncMPClient, queue.Queue())

    def add_request(self, request: EngineCoreRequest) -> None:
        self._route(request).add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self.balancer.forget(request_ids).items():
            self.engines[rank].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        self.ensure_alive()
        item = self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put(item)  # every later caller fails the same way
        return self._received(item)

    def call_utility(self, method: str, *args, timeout: float = 60.0):
        self.ensure_alive()
        outcomes = []
        for engine in self.engines:
            try:
                outcomes.append(engine.call_utility(method, *args, timeout=timeout))
            except (EngineUtilityError, EngineDeadError) as error:
                outcomes.append(error)
        return self._combine(method, outcomes)


class DPAsyncClient(_DataParallelGroup, AsyncOnlyClient):
    """asyncio data-parallel client for ``AsyncLLM``."""

    def __init__(self, config: EngineConfig):
        super().__init__(config, AsyncMPClient, asyncio.Queue())

    def start(self) -> None:
        """Start every engine's output reader on the running event loop (idempotent)."""
        for engine in self.engines:
            engine.start()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.start()
        await self._route(request).add_request_async(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.start()
        for rank, ids in self.balancer.forget(request_ids).items():
            await self.engines[rank].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self.start()
        self.ensure_alive()
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)
        return self._received(item)

    async def call_utility_async(self, method: str, *args, timeout: float = 60.0):
        self.start()
        self.ensure_alive()
        outcomes = await asyncio.gather(*[engine.call_utility_async(method, *args, timeout=timeout)
                                          for engine in self.engines], return_exceptions=True)
        return self._combine(method, outcomes)

