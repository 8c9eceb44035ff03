"""Per-request hand-off from the output handler to the consumer of ``AsyncLLM.generate``.

The collector holds at most one pending item: if the consumer lags, delta outputs are merged into it
(text and tokens appended), cumulative and final ones replace it, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses

from quire.core.outputs import CompletionOutput, RequestOutput
from quire.core.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """``deadline``: the ``time.monotonic()`` by which the request must finish (None: no limit)."""

    def __init__(self, output_kind: RequestOutputKind, deadline: float | None = None):
        self.output_kind = output_kind
        self.deadline = deadline
        self._pending: RequestOutput | BaseException | None = None
        # A bare future per wait, from the loop found on the first wait: asyncio.Event asks for the
        # running loop on every wait, which costs a getpid() system call per streamed token on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if (isinstance(item, RequestOutput) and isinstance(pending, RequestOutput)
                and self.output_kind == RequestOutputKind.DELTA):
            self._pending = merge_deltas(pending, item)
        elif not isinstance(pending, BaseException):
            self._pending = item
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> RequestOutput | None:
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> RequestOutput:
        while self._pending is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            await self._waiter
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
