"""``RayExecutor``: tensor parallelism over Ray actors, one placement-group bundle per rank.

```
 engine-core process (a Ray driver)                   Ray actor (rank r = 1 … N-1), bundle r
 ┌──────────────────────────────────────┐  actor call   ┌──────────────────────────────────┐
 │ EngineCore → RayExecutor              │ ────────────► │ RayWorker: ModelRunner(rank r)   │
 │   ModelRunner(rank 0), bundle 0       │  one encoded  │   executes every step, returns   │
 │   (reserves this node's CPUs)         │  call a step  │   nothing                         │
 └──────────────────────────────────────┘               └──────────────────────────────────┘
            └──── gloo inside each forward: 127.0.0.1 on one node, the nodes' addresses across nodes ────┘
```

The protocol is ``TensorParallelExecutor``'s (``mp_executor``); only the transport differs. Calls are actor
tasks, which Ray runs in the order they were submitted; the engine core does not wait for them. Their
references are kept and collected before the next call with a zero-timeout ``ray.wait``, so an actor that
died (or whose node was lost) fails the next call with ``EngineDeadError``, and one that dies during a step
fails rank 0's collective (its sockets close) as a worker process does. Ray is imported when the executor
is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from quire.core.config import EngineConfig
from quire.core.distributed.group import LOOPBACK
from quire.core.distributed.ray_utils import ensure_ray_initialized
from quire.core.engine.mp_executor import STARTUP_TIMEOUT_SECONDS, TensorParallelExecutor, TensorParallelWorker
from quire.core.errors import ConfigError, EngineDeadError

logger = logging.getLogger(__name__)

# How long the cluster may take to find room for every rank's bundle before the engine gives up.
PLACEMENT_TIMEOUT_SECONDS = 60.0


class RayWorker(TensorParallelWorker):
    """A ``TensorParallelWorker`` as a Ray actor. A call that raises ends the actor's process (an actor
    would otherwise live on and leave its peers waiting in the step's collectives until gloo's timeout)."""

    def ready(self) -> None:
        """Answers once the actor is up and connected to the store."""

    def handle(self, payload: bytes) -> bool:
        try:
            return super().handle(payload)
        except BaseException:
            logger.exception("tensor-parallel rank %d failed; ending its actor", self.rank)
            os._exit(1)


@dataclasses.dataclass
class RayWorkerHandle:
    rank: int
    actor: Any  # the ActorHandle of a RayWorker


class RayExecutor(TensorParallelExecutor):
    """Ranks 1 … N-1 as Ray actors in a placement group (``PACK``): bundle r holds rank r's CPUs
    (``config.num_threads``), bundle 0 is pinned to this node and reserves the engine core's."""

    name = "ray"

    def __init__(self, config: EngineConfig):
        self.ray = ensure_ray_initialized()
        self.workers: list[RayWorkerHandle] = []
        self.placement_group = None
        self.loading: list = []  # each actor's load(), answered with its KV block count
        self.pending: dict[Any, int] = {}  # calls not yet seen finished: their reference → the rank
        super().__init__(config)

    def _place_ranks(self, config: EngineConfig) -> list[str]:
        from ray.util.placement_group import placement_group, placement_group_table

        ray, world_size = self.ray, config.parallel.tensor_parallel_size
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
        this_node = ray.get_runtime_context().get_node_id()
        bundles = [{"CPU": float(config.num_threads or 1)} for _ in range(world_size)]
        bundles[0][f"node:{addresses[this_node]}"] = 0.001  # rank 0 runs here, in the engine core
        self.placement_group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_SECONDS)
        if not ready:
            raise ConfigError(f"the Ray cluster found no room in {PLACEMENT_TIMEOUT_SECONDS:.0f} s for "
                              f"tensor_parallel_size={world_size} bundles of {config.num_threads or 1} CPUs "
                              f"(rank 0's on this node); available: {ray.available_resources()}")
        node_ids = placement_group_table(self.placement_group)["bundles_to_node_id"]
        if all(node_ids[rank] == this_node for rank in range(world_size)):
            return [LOOPBACK] * world_size
        return [addresses[node_ids[rank]] for rank in range(world_size)]

    def _start_workers(self, config: EngineConfig, hosts: list[str], store_port: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = self.ray.remote(RayWorker)
        world_size = config.parallel.tensor_parallel_size
        for rank in range(1, world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            actor = actor_class.options(num_cpus=config.num_threads or 1, scheduling_strategy=strategy,
                                        max_restarts=0).remote(config, rank, world_size, hosts[0], store_port,
                                                               hosts[rank])
            self.workers.append(RayWorkerHandle(rank, actor))
        self._get([worker.actor.ready.remote() for worker in self.workers], "while starting")
        # NOTE: not waited for here: loading joins the group, which returns once rank 0 has joined too
        self.loading = [worker.actor.load.remote() for worker in self.workers]

    def _receive_num_blocks(self) -> list[int]:
        return self._get(self.loading, "while loading")

    def _send_payload(self, payload: bytes) -> None:
        for worker in self.workers:
            self.pending[worker.actor.handle.remote(payload)] = worker.rank

    def _check_workers(self) -> None:
        if not self.pending:
            return
        done, _ = self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0, fetch_local=False)
        for reference in done:
            rank = self.pending.pop(reference)
            try:
                self.ray.get(reference)
            except self.ray.exceptions.RayError as error:
                raise EngineDeadError(f"tensor-parallel rank {rank} is gone: {error}") from error

    def _stop_workers(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            try:
                self.ray.kill(worker.actor, no_restart=True)
            except self.ray.exceptions.RayError:
                pass  # already gone
        self.pending.clear()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)

    def _get(self, references: list, when: str) -> list:
        """The references' values, waiting at most the startup timeout; EngineDeadError if an actor fails."""
        try:
            return self.ray.get(references, timeout=STARTUP_TIMEOUT_SECONDS)
        except self.ray.exceptions.GetTimeoutError:
            raise EngineDeadError(f"a tensor-parallel rank did not answer within {STARTUP_TIMEOUT_SECONDS:.0f} s "
                                  f"{when}") from None
        except self.ray.exceptions.RayError as error:
            raise EngineDeadError(f"a tensor-parallel rank failed {when}: {error}") from error
