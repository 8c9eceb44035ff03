"""A scripted ``EngineClient`` with nothing but the protocol's members, for the server's unit tests.

Requests go through the real ``Renderer`` and ``InputProcessor`` (so validation is the engine's); each
sequence then "generates" the same scripted token ids. Any attribute the server reads beyond the protocol
raises ``AttributeError`` here, which the route tests turn into a failure.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import AsyncIterator, Iterable
from typing import Any

from quire.core.config import ModelConfig
from quire.core.engine.input_processor import InputProcessor
from quire.core.engine.protocol import OutputStream, StatLogger
from quire.core.errors import EngineDeadError, EngineUtilityError
from quire.core.lora.request import LoRARequest
from quire.core.outputs import CompletionOutput, EngineMetrics, PoolingRequestOutput, RequestOutput
from quire.core.pooling_params import PoolingParams
from quire.core.renderer import PromptType, Renderer
from quire.core.sampling_params import RequestOutputKind, SamplingParams


def protocol_members(protocol: type) -> set[str]:
    """Public names a protocol declares (methods, properties and annotated attributes), with its bases'."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        names |= {name for name in vars(cls) if not name.startswith("_")}
        names |= {name for name in getattr(cls, "__annotations__", {}) if not name.startswith("_")}
    return names


class FakeStream:
    """The scripted outputs of one request (one output per token, or one at the end)."""

    def __init__(self, engine: FakeEngineClient, request_id: str, prompt_token_ids: list[int],
                 prompt: str | None, params: SamplingParams):
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self._engine, self._request_id, self._params = engine, request_id, params
        self._outputs = self._script()

    def _script(self) -> AsyncIterator[RequestOutput]:
        async def outputs():
            params, script = self._params, self._engine._script[:self._params.max_tokens]
            ends = [len(script)] if params.output_kind == RequestOutputKind.FINAL_ONLY else range(1, len(script) + 1)
            for end in ends:
                finished = end == len(script)
                token_ids = script[end - 1:end] if params.output_kind == RequestOutputKind.DELTA else script[:end]
                completions = [CompletionOutput(index, self._engine.renderer.detokenize(token_ids), list(token_ids),
                                                "length" if finished else None) for index in range(params.n)]
                yield RequestOutput(self._request_id, self.prompt, self.prompt_token_ids, completions, finished)
            self._engine._in_flight.discard(self._request_id)
        return outputs()

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        self._engine._in_flight.discard(self._request_id)
        await self._outputs.aclose()


class FakeEngineClient:
    """``EngineClient`` over no engine: ``script`` is what every sequence generates. Its state is private:
    every public name it has is one the protocol declares (tests check this), so a server that reads
    anything else fails against it."""

    def __init__(self, model_config: ModelConfig, tokenizer, max_model_len: int = 128,
                 script: tuple[int, ...] = (40, 41, 42, 43)):
        self.model_config = dataclasses.replace(model_config, max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.task = "generate"
        self.renderer = Renderer(tokenizer, model_config.vocab_size)
        self._script = list(script)
        self._in_flight: set[str] = set()
        self._stat_loggers: list[StatLogger] = []
        self._input_processor = InputProcessor(self.model_config, self.renderer, max_model_len)
        self._dead = False

    # -- EngineClientBase
    @property
    def errored(self) -> bool:
        return self._dead

    @property
    def is_running(self) -> bool:
        return not self._dead

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError("the fake engine is dead")

    def check_health(self) -> None:
        if self._dead:
            raise self.dead_error

    def get_tokenizer(self) -> Any:
        return self.renderer.tokenizer

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(None, [])

    def shutdown(self) -> None:
        self._dead = True

    # -- EngineClient
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                          timeout: float | None = None, data_parallel_rank: int | None = None,
                          lora_request: LoRARequest | None = None) -> OutputStream:
        self.check_health()
        request, text = self._input_processor.process(request_id, prompt, params, arrival_time, priority,
                                                      cache_salt, data_parallel_rank, lora_request)
        self.check_admission(params.n, len(request.prompt_token_ids))
        self._in_flight.add(request_id)
        return FakeStream(self, request_id, request.prompt_token_ids, text, request.sampling_params)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None, timeout: float | None = None,
                       data_parallel_rank: int | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                        data_parallel_rank=data_parallel_rank, lora_request=lora_request)
        async for output in stream:
            yield output

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str, *, priority: int = 0,
                     timeout: float | None = None,
                     data_parallel_rank: int | None = None) -> AsyncIterator[PoolingRequestOutput]:
        # a generative engine: the input processor refuses pooling requests, naming "model"
        self._input_processor.process(request_id, prompt, params, priority=priority,
                                      data_parallel_rank=data_parallel_rank)
        raise AssertionError("a generate engine accepted a pooling request")
        yield

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._in_flight.difference_update(ids)

    def check_admission(self, num_sequences: int = 1, num_prompt_tokens: int = 0) -> None:
        pass

    @property
    def unfinished_request_ids(self) -> list[str]:
        return sorted(self._in_flight)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers.append(stat_logger)

    async def reset_prefix_cache(self) -> bool:
        return True

    async def get_debug_state(self) -> dict[str, Any]:
        return {"engine": {"num_running_reqs": 0}, "front_end": {"tracked_requests": len(self._in_flight)}}

    async def get_step_timings(self, reset: bool = False) -> dict[str, Any]:
        return {"num_steps": 0}

    async def check_idle_invariants(self) -> None:
        if self._in_flight:
            raise EngineUtilityError(f"{len(self._in_flight)} requests in flight")
