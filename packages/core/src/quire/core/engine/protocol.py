"""``EngineClient``: the one seam every front end (offline ``LLM``, server, CLI) depends on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from quire.core.config import ModelConfig
from quire.core.engine.input_processor import PromptType
from quire.core.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """What a front end may rely on, whether the engine core runs in-process or elsewhere.

    ``add_request`` validates and tokenizes at once, raising ``ValidationError`` for bad input, and
    returns without waiting for generation; how outputs come back (``LLMEngine.step`` or an async
    stream) is the concrete client's business. ``abort_request`` of an unknown id does nothing.
    """

    model_config: ModelConfig

    def get_tokenizer(self): ...

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0) -> None: ...

    def abort_request(self, request_ids: Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def shutdown(self) -> None: ...
