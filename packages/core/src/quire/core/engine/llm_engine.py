"""``LLMEngine``: the synchronous engine client (add requests, call ``step`` until done)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import msgspec

from quire.core.chat import Conversation, render_chat
from quire.core.config import EngineConfig
from quire.core.engine.core_client import EngineCoreClient, InprocClient
from quire.core.engine.input_processor import InputProcessor, PromptType
from quire.core.engine.output_processor import OutputProcessor, ParentRequest
from quire.core.engine_args import EngineArgs
from quire.core.errors import EngineDeadError, ValidationError
from quire.core.outputs import RequestMetrics, RequestOutput
from quire.core.sampling_params import SamplingParams
from quire.core.tokenizer import load_tokenizer
from quire.core.wire import EngineCoreRequest, SchedulerStats


@dataclasses.dataclass
class EngineMetrics:
    """The latest scheduler statistics and the timings of recently finished requests."""

    scheduler: SchedulerStats | None
    finished_requests: list[RequestMetrics]


def make_sync_client(config: EngineConfig) -> EngineCoreClient:
    """The engine core in its own process (over ZMQ), unless ``config.multiprocess`` is off."""
    if not config.multiprocess:
        return InprocClient(config)
    from quire.core.engine.mp_client import SyncMPClient

    return SyncMPClient(config)


def fan_out(output_processor: OutputProcessor, request: EngineCoreRequest,
            prompt_text: str | None) -> list[EngineCoreRequest]:
    """Register a request with the output processor; return the engine requests to send.

    With ``n > 1`` the request becomes ``n`` children ``id#i`` under one ``ParentRequest``; child ``i``
    is seeded ``seed + i``, and only the first computes prompt logprobs (the prompt is shared).
    """
    params = request.sampling_params
    if params.n == 1:
        output_processor.add_request(request, prompt_text)
        return [request]
    children = []
    for index in range(params.n):
        child_params = msgspec.structs.replace(
            params, n=1, seed=None if params.seed is None else params.seed + index,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None)
        children.append(msgspec.structs.replace(request, request_id=f"{request.request_id}#{index}",
                                                sampling_params=child_params))
    parent = ParentRequest(request.request_id, [c.request_id for c in children], params.output_kind)
    for index, child in enumerate(children):
        output_processor.add_request(child, prompt_text, parent, index)
    return children


class LLMEngine:
    """Front-end processing around an engine core, driven by the caller's ``step`` loop."""

    def __init__(self, config: EngineConfig, engine_core: EngineCoreClient | None = None):
        self.config = config
        self.model_config = config.model
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.engine_core = engine_core or make_sync_client(config)
        self.max_model_len = self.engine_core.max_model_len
        self.input_processor = InputProcessor(config.model, self.tokenizer, self.max_model_len,
                                              config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        self.scheduler_stats: SchedulerStats | None = None
        self.reset_frontend_timings()

    def reset_frontend_timings(self) -> None:
        """Seconds this process spent waiting for engine outputs and turning them into RequestOutputs."""
        self.frontend_timings = {"waiting": 0.0, "output_processing": 0.0}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def errored(self) -> bool:
        return self.engine_core.engine_dead

    @property
    def is_running(self) -> bool:
        return not self.errored

    def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError("the engine core is dead; no more requests can be served")

    def render_chat(self, messages: Conversation, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        return render_chat(self.tokenizer, messages, chat_template, add_generation_prompt,
                           continue_final_message, chat_template_kwargs)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request; with ``params.n > 1`` it runs as ``n`` seeded children."""
        if self.output_processor.is_in_flight(request_id):
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        request, prompt_text = self.input_processor.process(request_id, prompt, params, arrival_time,
                                                            priority, cache_salt)
        for engine_request in fan_out(self.output_processor, request, prompt_text):
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
        if engine_outputs.scheduler_stats is not None:
            self.scheduler_stats = engine_outputs.scheduler_stats
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        self.frontend_timings["waiting"] += received - started
        self.frontend_timings["output_processing"] += time.perf_counter() - received
        return request_outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests are running."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def check_idle_invariants(self) -> bool:
        """Raise unless nothing (requests, KV blocks, runner rows) is left in the engine core."""
        return self.engine_core.call_utility("check_idle_invariants")

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(self.scheduler_stats, list(self.output_processor.finished_metrics))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
