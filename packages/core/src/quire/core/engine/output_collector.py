"""Per-request hand-off from ``AsyncLLM``'s output handler to the request's consumer: the
``RequestOutputCollector`` it fills and the ``RequestStream`` the consumer reads.

The collector holds at most one pending item: if the consumer lags, delta outputs are merged into it
(text and tokens appended), cumulative and final ones replace it, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from quire.core.errors import EngineGenerateError, QueueTimeoutError, RequestTimeoutError
from quire.core.outputs import CompletionOutput, RequestOutput
from quire.core.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from quire.core.engine.async_llm import AsyncLLM


class RequestOutputCollector:
    """``deadline``: the ``time.monotonic()`` by which the request must finish (None: no limit)."""

    __slots__ = ("output_kind", "deadline", "_pending", "_loop", "_waiter", "sink", "text_sink")

    def __init__(self, output_kind: RequestOutputKind, deadline: float | None = None):
        self.output_kind = output_kind
        self.deadline = deadline
        self._pending: RequestOutput | BaseException | None = None
        # A bare future per wait, from the loop found on the first wait: asyncio.Event asks for the
        # running loop on every wait, which costs a getpid() system call per streamed token on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None
        # A consumer's synchronous hand-off (``RequestStream.set_sink``): offered each output while the
        # consumer waits with nothing pending; True means it was delivered there and then.
        self.sink: Callable[[RequestOutput], bool] | None = None
        # The same for a plain request's unfinished steps, as new text and token ids (``set_text_sink``).
        self.text_sink: Callable[[str, list[int]], bool] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if (pending is None and self.sink is not None and self._waiter is not None and not self._waiter.done()
                and isinstance(item, RequestOutput) and not item.finished and self.sink(item)):
            return
        if (isinstance(item, RequestOutput) and isinstance(pending, RequestOutput)
                and self.output_kind == RequestOutputKind.DELTA):
            self._pending = merge_deltas(pending, item)
        elif not isinstance(pending, BaseException):
            self._pending = item
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def offer_text(self, text: str, token_ids: list[int]) -> bool:
        """The output processor's text hand-off: the text sink takes a step while the consumer waits with
        nothing pending (True), or the step goes the usual way as an output (False)."""
        return (self._pending is None and self._waiter is not None and self.text_sink is not None
                and self.text_sink(text, token_ids))

    def get_nowait(self) -> RequestOutput | None:
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> RequestOutput:
        while self._pending is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled: no longer waiting (``put`` clears it when it wakes us)
                    self._waiter = None
        return self.get_nowait()


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta output equal to ``earlier`` followed by ``later``."""
    completions = {c.index: c for c in earlier.outputs}
    for new in later.outputs:
        old = completions.get(new.index)
        completions[new.index] = new if old is None else _merge_completion(old, new)
    return dataclasses.replace(later, outputs=[completions[i] for i in sorted(completions)])


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = None if new.logprobs is None else (old.logprobs or []) + new.logprobs
    return dataclasses.replace(new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
                               logprobs=logprobs)


class RequestStream:
    """The outputs of one request added with ``AsyncLLM.add_request``, as an async iterator that ends after
    the final output. Cancelling a wait on it, or ``aclose()`` before the end, aborts the request."""

    __slots__ = ("_engine", "request_id", "_collector", "_finished", "prompt_token_ids", "prompt")

    def __init__(self, engine: AsyncLLM, request_id: str, collector: RequestOutputCollector,
                 prompt_token_ids: list[int], prompt: str | None):
        self._engine = engine
        self.request_id = request_id
        self._collector = collector
        self._finished = False
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt

    def __aiter__(self) -> RequestStream:
        return self

    def set_sink(self, sink: Callable[[RequestOutput], bool] | None) -> None:
        """Deliver outputs synchronously, from the engine's output handler, to ``sink`` whenever this stream's
        reader is waiting and nothing is queued ahead of them: the output is the sink's when it returns True,
        and is queued for the reader as usual when it returns False. The final output is never offered:
        the reader always gets it, and anything the sink declines, in order. A streaming server writes each
        output's events this way, without waking the reader's task for every token. None removes the sink."""
        self._collector.sink = sink

    def set_text_sink(self, sink: Callable[[str, list[int]], bool] | None) -> bool:
        """Like ``set_sink``, one step earlier: while this stream's reader waits with nothing queued, each unfinished
        step of a plain request (a delta stream of its own, every token sent, no logprobs) with nothing else on
        it is offered to ``sink(text, token_ids)`` before any ``RequestOutput`` is built; one it declines is
        built and delivered as usual (the ``set_sink`` sink first). False when the request does not qualify
        (nothing set); None removes the sink."""
        self._collector.text_sink = sink
        return self._engine.output_processor.set_text_sink(
            self.request_id, None if sink is None else self._collector.offer_text)

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        collector = self._collector
        output = collector.get_nowait()
        if output is None:
            try:
                output = await (collector.get() if collector.deadline is None else self._next_with_deadline())
            except asyncio.CancelledError:
                self._abandon()
                raise
        if output.finished:
            self._finished = True
            self._engine.collectors.pop(self.request_id, None)
            reasons = ({c.finish_reason for c in output.outputs} if isinstance(output, RequestOutput)
                       else {output.finish_reason})
            if "error" in reasons:
                raise EngineGenerateError(f"the engine failed request {self.request_id!r}")
            if "queue_timeout" in reasons:
                raise QueueTimeoutError(f"request {self.request_id!r} waited longer than max_queue_time for the "
                                        "engine; retry later")
        return output

    async def _next_with_deadline(self) -> RequestOutput:
        collector = self._collector
        try:
            return await asyncio.wait_for(collector.get(), max(0.0, collector.deadline - time.monotonic()))
        except TimeoutError:
            self._abandon()
            raise RequestTimeoutError(f"request {self.request_id!r} ran past its time limit and was aborted") from None

    def _abandon(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._abort_now([self.request_id])

    async def aclose(self) -> None:
        """Stop reading; a request that has not finished is aborted."""
        self._abandon()
