"""``LLMEngine``: the synchronous engine client (add requests, call ``step`` until done)."""

from __future__ import annotations

from collections.abc import Iterable

from quire.core.chat import Conversation, render_chat
from quire.core.config import EngineConfig
from quire.core.engine.core_client import EngineCoreClient, InprocClient
from quire.core.engine.input_processor import InputProcessor, PromptType
from quire.core.engine.output_processor import OutputProcessor
from quire.core.engine_args import EngineArgs
from quire.core.outputs import RequestOutput
from quire.core.sampling_params import SamplingParams
from quire.core.tokenizer import load_tokenizer
from quire.core.wire import SchedulerStats


class LLMEngine:
    """Front-end processing around an engine core, driven by the caller's ``step`` loop."""

    def __init__(self, config: EngineConfig, engine_core: EngineCoreClient | None = None):
        self.config = config
        self.model_config = config.model
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.engine_core = engine_core or InprocClient(config)
        self.input_processor = InputProcessor(config.model, self.tokenizer,
                                              self.engine_core.max_model_len)
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
                    arrival_time: float | None = None, priority: int = 0) -> None:
        request, prompt_text = self.input_processor.process(request_id, prompt, params,
                                                            arrival_time, priority)
        self.output_processor.add_request(request, prompt_text)
        self.engine_core.add_request(request)

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

    def shutdown(self) -> None:
        self.engine_core.shutdown()
