"""The seams every front end depends on: ``EngineClient`` (asyncio: the server, ``quire run-batch``) and
``SyncEngineClient`` (a caller-driven step loop: the offline ``LLM``).

Front ends touch engines only through these protocols, so another implementation (several engine cores
behind one client, a scripted fake in unit tests) slots in. ``AsyncLLM`` and ``LLMEngine`` implement them
over the same ``EngineCore``. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol, runtime_checkable

from quire.core.config import ModelConfig
from quire.core.errors import EngineDeadError
from quire.core.lora.request import LoRARequest
from quire.core.outputs import EngineMetrics, PoolingRequestOutput, RequestMetrics, RequestOutput
from quire.core.pooling_params import PoolingParams
from quire.core.renderer import PromptType, Renderer
from quire.core.sampling_params import SamplingParams
from quire.core.wire import SchedulerStats


class StatLogger(Protocol):
    """Receives, once per engine step, that engine core's scheduler statistics (None when the call carries
    none), its data-parallel rank ``engine_index`` (0 with one engine), and the metrics of the requests that
    finished since the last call, each naming its own engine (``RequestMetrics.engine_index``). Must not
    raise (errors are logged)."""

    def record(self, scheduler_stats: SchedulerStats | None, finished: list[RequestMetrics], *,
               engine_index: int = 0) -> None: ...


class OutputStream(Protocol):
    """One request's outputs, from ``EngineClient.add_request``: iterate until the final output;
    ``aclose()`` (or cancelling the iteration) before then aborts the request. ``prompt_token_ids`` are
    the tokens the engine runs (rendered, truncated); ``prompt`` their text (None for token-id prompts).
    ``AsyncLLM``'s streams also offer ``set_sink`` (see ``RequestStream``), which a consumer may use when present."""

    prompt_token_ids: list[int]
    prompt: str | None

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class EngineClientBase(Protocol):
    """What both kinds of client offer besides requests.

    ``model_config`` is the checkpoint's normalised configuration; ``max_model_len`` the context limit the
    engine core reported once it was ready. ``renderer`` is the one place that renders chat messages and
    turns text into token ids (and back) for this model. ``check_health()`` raises ``EngineDeadError``
    once the engine core can no longer serve; ``errored`` says the same without raising, ``dead_error``
    is the error callers get.
    """

    model_config: ModelConfig
    max_model_len: int
    renderer: Renderer
    task: str  # "generate" (SamplingParams requests), "embed" or "score" (PoolingParams requests)

    @property
    def errored(self) -> bool: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_error(self) -> EngineDeadError: ...

    def check_health(self) -> None: ...

    def get_tokenizer(self) -> Any: ...

    def get_metrics(self) -> EngineMetrics: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class EngineClient(EngineClientBase, Protocol):
    """An asyncio engine client. Request methods raise ``ValidationError`` (bad input, naming the field),
    ``OverloadedError`` (at capacity, retryable), ``EngineDeadError``; a started request's stream raises
    ``QueueTimeoutError``, ``RequestTimeoutError`` or ``EngineGenerateError`` as its documentation says.
    Utility calls raise ``EngineUtilityError`` whatever the transport.
    """

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, *,
                          arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                          timeout: float | None = None, data_parallel_rank: int | None = None,
                          lora_request: LoRARequest | None = None) -> OutputStream:
        """Render, validate, admit (``check_admission``) and send a request; every input error is raised
        here, before any output. ``timeout`` (seconds) bounds the whole request; ``data_parallel_rank``
        pins it to one engine core of a data-parallel group; ``lora_request`` names the LoRA adapter it
        runs with (None: the base model)."""

    def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *, priority: int = 0,
                 cache_salt: str | None = None, timeout: float | None = None,
                 data_parallel_rank: int | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its outputs until the request finishes."""

    def encode(self, prompt: PromptType, params: PoolingParams, request_id: str, *, priority: int = 0,
               timeout: float | None = None,
               data_parallel_rank: int | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """An embedding engine's pooling request (``add_request`` with ``PoolingParams``): yield its one
        ``PoolingRequestOutput``."""

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by their user ids (unknown or finished ids are ignored); their consumers get a
        final output with finish reason "abort"."""

    def check_admission(self, num_sequences: int = 1, num_prompt_tokens: int = 0) -> None:
        """Raise ``OverloadedError`` if work of this size would exceed the configured in-flight limits."""

    @property
    def unfinished_request_ids(self) -> list[str]:
        """User ids of the requests accepted and not finished."""

    def add_stat_logger(self, stat_logger: StatLogger) -> None: ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests hold blocks."""

    async def get_debug_state(self) -> dict[str, Any]:
        """What the engine core (``engine``) and this client (``front_end``) are holding now."""

    async def get_step_timings(self, reset: bool = False) -> dict[str, Any]:
        """Seconds per engine-step phase and the number of steps, since start-up or the last reset."""

    async def check_idle_invariants(self) -> None:
        """Raise ``EngineUtilityError`` describing what is left behind unless nothing is in flight
        anywhere (requests, KV blocks, runner rows, front-end state)."""


@runtime_checkable
class SyncEngineClient(EngineClientBase, Protocol):
    """A client driven by its caller: ``add_request``, then ``step()`` until ``has_unfinished_requests()``
    is false. Errors as ``EngineClient``'s."""

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, data_parallel_rank: int | None = None,
                    lora_request: LoRARequest | None = None) -> None: ...

    def abort_request(self, request_ids: Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs it produced."""

    def reset_prefix_cache(self) -> bool: ...

    def get_step_timings(self, reset: bool = False) -> dict[str, Any]: ...

    def check_idle_invariants(self) -> None: ...
