"""``AsyncLLM``: the asyncio engine client the server uses; it implements ``EngineClient``.

``add_request`` renders, validates and admits a request, then returns its ``RequestStream``. A background
output-handler task reads the engine core's outputs, runs them through the ``OutputProcessor`` and hands
each request's outputs to its ``RequestOutputCollector``, which the stream reads. Cancelling or closing a
stream before its end (a client disconnect) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from quire.core.config import EngineConfig
from quire.core.engine.front_end import FrontEnd
from quire.core.engine.output_collector import RequestOutputCollector, RequestStream
from quire.core.engine.protocol import StatLogger
from quire.core.engine_args import EngineArgs
from quire.core.errors import EngineDeadError, EngineUtilityError, OverloadedError, ValidationError
from quire.core.lora.request import LoRARequest
from quire.core.outputs import EngineMetrics, PoolingRequestOutput, RequestOutput
from quire.core.pooling_params import PoolingParams
from quire.core.renderer import PromptType, is_long
from quire.core.sampling_params import SamplingParams
from quire.core.wire import SchedulerStats

logger = logging.getLogger(__name__)
_OUTPUT_CHUNK = 256


class AsyncLLM:
    """The engine core in its own process, driven from an asyncio event loop."""

    def __init__(self, config: EngineConfig, engine_core=None, stat_loggers: list[StatLogger] | None = None):
        self.config = config
        self.model_config = config.model
        self.task = config.task  # "generate", "embed" or "score"
        if engine_core is None and config.parallel.uses_engine_group:
            from quire.core.engine.dp_client import DPAsyncClient

            engine_core = DPAsyncClient(config)
        elif engine_core is None:
            from quire.core.engine.mp_client import AsyncMPClient

            engine_core = AsyncMPClient(config)
        self.engine_core = engine_core
        self.max_model_len = engine_core.max_model_len
        self.front_end = FrontEnd(config, self.max_model_len)
        self.renderer = self.front_end.renderer
        self.output_processor = self.front_end.output_processor
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.scheduler_stats: SchedulerStats | None = None
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._output_handler: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        self._background: set[asyncio.Task] = set()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(args.create_engine_config())

    # -- health ---------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core.engine_dead

    @property
    def is_running(self) -> bool:
        return not self.errored and (self._output_handler is None or not self._output_handler.done())

    @property
    def dead_error(self) -> EngineDeadError:
        return self._dead_error or EngineDeadError("the engine core is dead; no requests can be served")

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine can no longer serve requests."""
        if self.errored:
            raise self.dead_error

    def check_admission(self, num_sequences: int = 1, num_prompt_tokens: int = 0) -> None:
        """Refuse (``OverloadedError``, retryable) work beyond the configured in-flight limits.

        A request counts as many sequences as its ``n``; in flight means accepted and not finished.
        """
        limits = self.config.scheduler
        in_flight = self.output_processor.num_unfinished_requests
        if limits.max_num_queued_reqs is not None and in_flight + num_sequences > limits.max_num_queued_reqs:
            raise OverloadedError(f"the engine is at capacity: {in_flight} sequences in flight, the limit is "
                                  f"{limits.max_num_queued_reqs}; retry later")
        if limits.max_num_queued_tokens is not None:
            queued_tokens = self.output_processor.num_unfinished_prompt_tokens
            if queued_tokens + num_prompt_tokens > limits.max_num_queued_tokens:
                raise OverloadedError(f"the engine is at capacity: {queued_tokens} prompt tokens in flight, "
                                      f"the limit is {limits.max_num_queued_tokens}; retry later")

    # -- requests ------------------------------------------------------------------------------

    def get_tokenizer(self):
        return self.renderer.tokenizer

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, *,
                          arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                          timeout: float | None = None, data_parallel_rank: int | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Render, validate, admit and send a request; return the stream its outputs will arrive in.
        With a ``timeout`` (seconds), the stream aborts the request and raises ``RequestTimeoutError``
        once it has run that long; ``data_parallel_rank`` pins it to that engine core."""
        self.check_health()
        self._start_output_handler()
        if timeout is not None and timeout <= 0:
            raise ValidationError(f"timeout must be positive, got {timeout}", param="timeout")
        process = (self.front_end.process, request_id, prompt, params, arrival_time, priority, cache_salt,
                   data_parallel_rank, lora_request)
        if is_long(prompt):  # rendering and tokenizing long inputs would stall every other stream
            request, prompt_text = await asyncio.to_thread(*process)
        else:
            request, prompt_text = process[0](*process[1:])
        params = request.sampling_params  # a pooling request's: one sequence, its output when it finishes
        self.check_admission(params.n, params.n * len(request.prompt_token_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        collector = RequestOutputCollector(params.output_kind, deadline)
        engine_requests = self.front_end.register(request, prompt_text)
        self.collectors[request_id] = collector
        try:
            for engine_request in engine_requests:
                await self.engine_core.add_request_async(engine_request)
        except BaseException:
            self._abort_now([request_id])
            raise
        return RequestStream(self, request_id, collector, request.prompt_token_ids, prompt_text)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None, timeout: float | None = None,
                       data_parallel_rank: int | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Raises ``ValidationError`` for bad input,
        ``OverloadedError`` when at capacity (``QueueTimeoutError`` when it waited past
        ``max_queue_time``), ``RequestTimeoutError`` past ``timeout`` seconds, ``EngineGenerateError`` if
        the engine failed the request and ``EngineDeadError`` if the engine died."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                        timeout=timeout, data_parallel_rank=data_parallel_rank,
                                        lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str, *, priority: int = 0,
                     timeout: float | None = None,
                     data_parallel_rank: int | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """An embedding engine's pooling request: yield its one ``PoolingRequestOutput``. Raises as
        ``generate`` does (``ValidationError`` naming ``model`` on an engine whose task is not "embed")."""
        if not isinstance(params, PoolingParams):
            raise ValidationError("pooling_params must be a PoolingParams", param="pooling_params")
        stream = await self.add_request(request_id, prompt, params, priority=priority, timeout=timeout,
                                        data_parallel_rank=data_parallel_rank)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored); frees their KV blocks. A consumer
        of the request's stream receives a final output whose finish reason is "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        engine_ids, final_outputs = self.output_processor.abort_requests(ids)
        for output in final_outputs:
            collector = self.collectors.pop(output.request_id, None)
            if collector is not None:
                collector.put(output)
        self._record_stats()
        if engine_ids and not self.engine_core.engine_dead:
            await self.engine_core.abort_requests_async(engine_ids)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return self.output_processor.unfinished_request_ids

    def _abort_now(self, request_ids: list[str]) -> None:
        """Abort without awaiting (for a consumer that is gone): the message is sent by a task."""
        for request_id in request_ids:
            self.collectors.pop(request_id, None)
        engine_ids, _ = self.output_processor.abort_requests(request_ids)
        self._record_stats()
        if engine_ids and not self.engine_core.engine_dead:
            task = asyncio.get_running_loop().create_task(self.engine_core.abort_requests_async(engine_ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- outputs -------------------------------------------------------------------------------

    def _start_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="quire-output-handler")

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if outputs.scheduler_stats is not None:  # the whole group's, with several engine cores
                    self.scheduler_stats = outputs.group_scheduler_stats or outputs.scheduler_stats
                engine_outputs = outputs.outputs
                for start in range(0, len(engine_outputs), _OUTPUT_CHUNK):
                    if start:
                        await asyncio.sleep(0)  # let consumers run between chunks of a large step
                    await self._dispatch(engine_outputs[start:start + _OUTPUT_CHUNK], outputs.engine_index)
                self._record_stats(outputs.scheduler_stats, outputs.engine_index)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - the engine is gone: tell every waiter
            if not isinstance(error, EngineDeadError):
                logger.exception("the output handler failed")
            self._dead_error = (error if isinstance(error, EngineDeadError)
                                else EngineDeadError(f"the output handler failed: {error}"))
            for collector in self.collectors.values():
                collector.put(self._dead_error)
            self.collectors.clear()

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    def _record_stats(self, stats: SchedulerStats | None = None, engine_index: int = 0) -> None:
        """Hand the stat loggers this message's scheduler stats (None: it carried none), the rank of the
        engine core that sent them, and the requests finished since."""
        finished = self.output_processor.take_newly_finished()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats, finished, engine_index=engine_index)
            except Exception:  # noqa: BLE001 - metrics must never take the server down
                logger.exception("a stat logger failed")

    async def _dispatch(self, engine_outputs, engine_index: int) -> None:
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs, engine_index)
        for output in request_outputs:
            collector = self.collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
        if to_abort:
            await self.engine_core.abort_requests_async(to_abort)

    # -- utilities -----------------------------------------------------------------------------

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def get_debug_state(self) -> dict[str, Any]:
        return {"engine": await self.engine_core.call_utility_async("get_stats"),
                "front_end": {"tracked_requests": self.output_processor.num_unfinished_requests,
                              "open_collectors": len(self.collectors)}}

    async def get_step_timings(self, reset: bool = False) -> dict[str, Any]:
        return await self.engine_core.call_utility_async("get_step_timings", reset)

    async def check_idle_invariants(self) -> None:
        """Raise ``EngineUtilityError`` (with what is left behind) unless nothing is in flight anywhere."""
        problems = []
        try:
            await self.engine_core.call_utility_async("check_idle_invariants")
        except EngineUtilityError as error:
            problems.append(str(error))
        if self.output_processor.num_unfinished_requests or self.collectors:
            problems.append("the front end still tracks requests")
        if problems:
            raise EngineUtilityError("; ".join(problems))

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(self.scheduler_stats, list(self.output_processor.finished_metrics))

    def shutdown(self) -> None:
        for task in [self._output_handler, *self._background]:
            if task is not None and not task.done():
                task.cancel()
        self.engine_core.shutdown()

