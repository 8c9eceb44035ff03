"""``LLMEngine``: the synchronous engine client (add requests, call ``step`` until done)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import msgspec

from quire.core.chat import Conversation, render_chat
from quire.core.config import EngineConfig
from quire.core.engine.core_client import EngineCoreClient, InprocClient
from quire.core.engine.input_processor import InputProcessor, PromptType
from quire.core.engine.output_processor import OutputProcessor, ParentRequest
from quire.core.engine_args import EngineArgs
from quire.core.errors import ValidationError
from quire.core.outputs import RequestMetrics, RequestOutput
from quire.core.sampling_params import SamplingParams
from quire.core.tokenizer import load_tokenizer
from quire.core.wire import SchedulerStats


@dataclasses.dataclass
class EngineMetrics:
    """The latest scheduler statistics and the timings of recently finished requests."""

    scheduler: SchedulerStats | None
    finished_requests: list[RequestMetrics]


class LLMEngine:
    """Front-end processing around an engine core, driven by the caller's ``step`` loop."""

    def __init__(self, config: EngineConfig, engine_core: EngineCoreClient | None = None):
        self.config = config
        self.model_config = config.model
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.engine_core = engine_core or InprocClient(config)
        self.input_processor = InputProcessor(config.model, self.tokenizer,
                                              self.engine_core.max_model_len, config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.scheduler_stats: SchedulerStats | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def get_tokenizer(self):
        return self.tokenizer

    def render_chat(self, messages: Conversation, chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return render_chat(self.tokenizer, messages, chat_template, add_generation_prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request; with ``params.n > 1`` it runs as ``n`` seeded children."""
        if self.output_processor.is_in_flight(request_id):
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        request, prompt_text = self.input_processor.process(request_id, prompt, params, arrival_time,
                                                            priority, cache_salt)
        if params.n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(request)
            return
        children = [self._child(request, i) for i in range(params.n)]
        parent = ParentRequest(request_id, [child.request_id for child in children], params.output_kind)
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index)
        for child in children:
            self.engine_core.add_request(child)

    @staticmethod
    def _child(request, index: int):
        params = request.sampling_params
        child_params = msgspec.structs.replace(
            params, n=1, seed=None if params.seed is None else params.seed + index,
            # the prompt is shared: only the first child computes its logprobs
            prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        )
        return msgspec.structs.replace(request, request_id=f"{request.request_id}#{index}",
                                       sampling_params=child_params)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        aborted = self.output_processor.abort_requests(list(request_ids))
        if aborted:
            self.engine_core.abort_requests(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs it produced."""
        engine_outputs = self.engine_core.get_output()
        if engine_outputs.scheduler_stats is not None:
            self.scheduler_stats = engine_outputs.scheduler_stats
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return request_outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests are running."""
        return self.engine_core.reset_prefix_cache()

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(self.scheduler_stats, list(self.output_processor.finished_metrics))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
