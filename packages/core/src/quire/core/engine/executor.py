"""The seam between ``EngineCore`` and the model runner(s): the ``Executor`` contract and executors by name.

``EngineCore`` talks to the model only through an executor, so one that drives several runners (tensor
parallelism over worker processes or Ray actors) replaces ``UniProcExecutor`` without changing the engine
core. This module imports no torch; an executor imports its runners when it is built.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING

from quire.core.lazy_registry import LazyRegistry

if TYPE_CHECKING:
    from quire.core.config import EngineConfig
    from quire.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from quire.core.timing import StepTimings


class Executor(abc.ABC):
    """Runs the model for an ``EngineCore``: KV cache sizing and allocation, steps, request bookkeeping.

    Built as ``cls(config)``, which loads the model. The engine core then calls, in order:
    ``num_kv_blocks()`` once (the blocks every runner can hold, the reserved null block included; with
    several runners the smallest), ``initialize_kv_cache(num_blocks)`` once, then per step
    ``execute_model(scheduler_output, timings)`` and, between steps, ``remove_requests(ids)``; with
    several runners each sees every call and the executor returns one ``ModelRunnerOutput``.
    ``shutdown()`` is the last call and releases workers; an executor is not used after it.
    """

    @abc.abstractmethod
    def __init__(self, config: EngineConfig): ...

    @abc.abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks to allocate (from ``kv_cache_memory``, the CPU default or a profiled GPU pass)."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer (and capture CUDA graphs where the runner does)."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      timings: StepTimings | None = None) -> ModelRunnerOutput:
        """Run one scheduled step and return its sampled tokens and logprobs; ``timings`` gets each phase."""

    @abc.abstractmethod
    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests now (the scheduler's removed ids; unknown ids are ignored)."""

    @abc.abstractmethod
    def num_threads(self) -> int:
        """Intra-op threads one runner computes with (reported in the engine's stats)."""

    @abc.abstractmethod
    def num_runner_rows(self) -> int:
        """Requests still held in the runners' persistent batches: 0 once every removed id was forgotten."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the runners and any worker processes; idempotent."""


class UniProcExecutor(Executor):
    """One ``ModelRunner`` in the engine core's own process and thread."""

    def __init__(self, config: EngineConfig):
        from quire.core.worker.model_runner import ModelRunner  # torch stays out of light imports

        self.model_runner = ModelRunner(config)

    def num_kv_blocks(self) -> int:
        return self.model_runner.num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      timings: StepTimings | None = None) -> ModelRunnerOutput:
        return self.model_runner.execute(scheduler_output, timings)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        self.model_runner.remove_requests(request_ids)

    def num_threads(self) -> int:
        return self.model_runner.num_threads()

    def num_runner_rows(self) -> int:
        return self.model_runner.input_batch.num_reqs

    def shutdown(self) -> None:
        pass  # nothing outside this process to stop; the runner goes with the engine core


# Each executor's module is imported when asked for.
_EXECUTORS = LazyRegistry("executor", Executor)


def register_executor(name: str, module_name: str, class_name: str) -> None:
    """Make ``module_name.class_name`` available as ``name``; it is imported and checked when asked for."""
    _EXECUTORS.register(name, module_name, class_name)


def get_executor_class(name: str) -> type[Executor]:
    """The executor class registered under ``name``; ConfigError naming it if there is none."""
    return _EXECUTORS.get(name)


def default_executor_backend(config: EngineConfig) -> str:
    """The executor a config needs: when its model is split over several ranks, its
    ``distributed_executor_backend`` ("mp": worker processes, "ray": Ray actors), else "uniproc"."""
    parallel = config.parallel
    return parallel.distributed_executor_backend if parallel.tensor_parallel_size > 1 else "uniproc"


register_executor("uniproc", "quire.core.engine.executor", "UniProcExecutor")
register_executor("mp", "quire.core.engine.mp_executor", "MultiprocExecutor")
register_executor("ray", "quire.core.engine.ray_executor", "RayExecutor")
