"""``LLMEngine``: the synchronous engine client (add requests, call ``step`` until done); it implements
``SyncEngineClient``, the seam the offline ``LLM`` uses."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from quire.core.config import EngineConfig
from quire.core.engine.core_client import EngineCoreClient, InprocClient
from quire.core.engine.front_end import FrontEnd
from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError, EngineDeadError, EngineUtilityError
from quire.core.lora.request import LoRARequest
from quire.core.outputs import EngineMetrics, RequestOutput
from quire.core.pooling_params import PoolingParams
from quire.core.renderer import PromptType
from quire.core.sampling_params import SamplingParams
from quire.core.wire import SchedulerStats


def default_multiprocess() -> bool:
    """The engine core runs in its own process unless ``QUIRE_MULTIPROCESS_ENGINE=0``."""
    return os.environ.get("QUIRE_MULTIPROCESS_ENGINE", "1") != "0"


def make_sync_client(config: EngineConfig, multiprocess: bool | None = None) -> EngineCoreClient:
    """The engine core in its own process (over ZMQ), or in this one with ``multiprocess=False``; with
    ``data_parallel_size`` > 1 (or engine cores elsewhere), that many engine cores behind one client."""
    data_parallel_size = config.parallel.data_parallel_size
    if not (default_multiprocess() if multiprocess is None else multiprocess):
        if config.parallel.uses_engine_group:
            raise ConfigError(f"data_parallel_size={data_parallel_size} (or engine cores on other machines or "
                              "Ray) runs each engine core in its own process; it cannot be combined with "
                              "multiprocess=False (or QUIRE_MULTIPROCESS_ENGINE=0)")
        return InprocClient(config)
    if config.parallel.uses_engine_group:
        from quire.core.engine.dp_client import DPSyncClient

        return DPSyncClient(config)
    from quire.core.engine.mp_client import SyncMPClient

    return SyncMPClient(config)


class LLMEngine:
    """Front-end processing around an engine core, driven by the caller's ``step`` loop."""

    def __init__(self, config: EngineConfig, engine_core: EngineCoreClient | None = None,
                 multiprocess: bool | None = None):
        self.config = config
        self.model_config = config.model
        self.task = config.task  # "generate", "embed" or "score"
        self.engine_core = engine_core or make_sync_client(config, multiprocess)
        self.max_model_len = self.engine_core.max_model_len
        self.front_end = FrontEnd(config, self.max_model_len)
        self.renderer = self.front_end.renderer
        self.output_processor = self.front_end.output_processor
        self.scheduler_stats: SchedulerStats | None = None
        self.reset_frontend_timings()

    def reset_frontend_timings(self) -> None:
        """Seconds this process spent waiting for engine outputs and turning them into RequestOutputs."""
        self.frontend_timings = {"waiting": 0.0, "output_processing": 0.0}

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool | None = None) -> LLMEngine:
        return cls(args.create_engine_config(), multiprocess=multiprocess)

    def get_tokenizer(self):
        return self.renderer.tokenizer

    @property
    def errored(self) -> bool:
        return self.engine_core.engine_dead

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError("the engine core is dead; no more requests can be served")

    def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, data_parallel_rank: int | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; with ``params.n > 1`` it runs as ``n`` seeded children. With
        ``PoolingParams`` (an embedding engine) it is a pooling request: ``step`` returns its
        ``PoolingRequestOutput`` once it has finished.
        ``data_parallel_rank`` pins it to that engine core (with ``data_parallel_size`` > 1);
        ``lora_request`` names its LoRA adapter (with ``enable_lora``)."""
        request, prompt_text = self.front_end.process(request_id, prompt, params, arrival_time, priority,
                                                      cache_salt, data_parallel_rank, lora_request)
        for engine_request in self.front_end.register(request, prompt_text):
            self.engine_core.add_request(engine_request)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        aborted, _ = self.output_processor.abort_requests(list(request_ids))
        if aborted:
            self.engine_core.abort_requests(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs it produced."""
        started = time.perf_counter()
        engine_outputs = self.engine_core.get_output()
        received = time.perf_counter()
        if engine_outputs.scheduler_stats is not None:  # the whole group's, with several engine cores
            self.scheduler_stats = engine_outputs.group_scheduler_stats or engine_outputs.scheduler_stats
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs.outputs,
                                                                          engine_outputs.engine_index)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        self.frontend_timings["waiting"] += received - started
        self.frontend_timings["output_processing"] += time.perf_counter() - received
        return request_outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests are running."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def get_stats(self) -> dict[str, Any]:
        """The engine core's scheduler and KV-cache counters, KV blocks, steps and threads."""
        return self.engine_core.call_utility("get_stats")

    def get_step_timings(self, reset: bool = False) -> dict[str, Any]:
        """Seconds per engine-step phase and the number of steps (since start-up or the last reset)."""
        return self.engine_core.call_utility("get_step_timings", reset)

    def check_idle_invariants(self) -> None:
        """Raise ``EngineUtilityError`` unless nothing (requests, KV blocks, runner rows) is left anywhere."""
        if self.output_processor.has_unfinished_requests():
            raise EngineUtilityError("the front end still tracks requests")
        self.engine_core.call_utility("check_idle_invariants")

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(self.scheduler_stats, list(self.output_processor.finished_metrics))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
