"""Engine outputs (token ids) to user outputs (text, logprobs, finish reasons), one state per request.

A request with ``n > 1`` runs as ``n`` child requests in the engine; a ``ParentRequest`` gathers them
back under the user's request id.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from quire.core.engine.detokenizer import BytePieces, IncrementalDetokenizer
from quire.core.engine.logprobs import LogprobsAccumulator
from quire.core.errors import ValidationError
from quire.core.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from quire.core.sampling_params import RequestOutputKind
from quire.core.wire import EngineCoreOutput, EngineCoreRequest, EventType, FinishReason

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RequestState:
    request_id: str
    index: int  # completion index within its parent (0 without one)
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsAccumulator
    metrics: RequestMetrics
    stream_interval: int = 1
    sent_token_offset: int = 0  # tokens handed over so far
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Tokens that end a request and whose text is left out (EOS unless ignore_eos, stop token ids): a
    # request that stops on anything else (its grammar terminated) keeps its last token's text.
    stop_token_ids: frozenset[int] = frozenset()
    # A pooling request: no text, one vector at the end (None until it arrives).
    is_pooling: bool = False
    embedding: list[float] | None = None
    # A delta stream of its own (no parent), every token sent, no logprobs: its unfinished outputs take
    # ``OutputProcessor._plain_step`` (and a text sink, when one is set).
    plain: bool = False
    # A consumer's hand-off for a plain request's unfinished steps, called with the new text and token ids
    # in place of building a ``RequestOutput``; True when it took them (``OutputProcessor.set_text_sink``).
    text_sink: Callable[[str, list[int]], bool] | None = None

    @property
    def user_request_id(self) -> str:
        return self.parent.request_id if self.parent else self.request_id


@dataclasses.dataclass
class ParentRequest:
    """The user's request behind ``n`` child requests."""

    request_id: str
    child_ids: list[str]
    output_kind: RequestOutputKind
    finished: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == len(self.child_ids)


class OutputProcessor:
    """Detokenizes, applies stop strings and builds ``RequestOutput``s for the requests in flight."""

    def __init__(self, tokenizer, stream_interval: int = 1, max_finished_metrics: int = 10_000):
        self.tokenizer = tokenizer
        self.byte_pieces = BytePieces.of(tokenizer)
        self.stream_interval = stream_interval
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.finished_metrics: list[RequestMetrics] = []
        self._max_finished_metrics = max_finished_metrics
        self._newly_finished: list[RequestMetrics] = []

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    parent: ParentRequest | None = None, index: int = 0,
                    arrival_time: float | None = None) -> None:
        if request.request_id in self.request_states:
            raise ValidationError(f"request id {request.request_id!r} is already in use",
                                  param="request_id")
        params = request.sampling_params
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
        stream_interval = max(self.stream_interval, params.stream_interval or 1)
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id, index=index, parent=parent, prompt=prompt,
            prompt_token_ids=request.prompt_token_ids, output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params, self.byte_pieces),
            logprobs=LogprobsAccumulator(self.tokenizer, params.logprobs, params.prompt_logprobs),
            metrics=RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                                   num_prompt_tokens=len(request.prompt_token_ids),
                                   engine_index=request.data_parallel_rank or 0),
            stream_interval=stream_interval,
            stop_token_ids=frozenset(params.stop_token_ids).union(() if params.ignore_eos else request.eos_token_ids),
            is_pooling=request.pooling_params is not None,
            plain=(parent is None and params.output_kind == RequestOutputKind.DELTA and params.logprobs is None
                   and params.prompt_logprobs is None and request.pooling_params is None and stream_interval == 1),
        )
        if params.structured_outputs is not None:
            self.request_states[request.request_id].metrics.structured_output_backend = \
                params.structured_outputs.backend

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def is_in_flight(self, request_id: str) -> bool:
        """Whether a user request id is taken by a request still running."""
        return request_id in self.request_states or request_id in self.parent_requests

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.request_states)

    @property
    def unfinished_request_ids(self) -> list[str]:
        """User request ids (a parent's, not its children's) still in flight."""
        return list(dict.fromkeys(state.user_request_id for state in self.request_states.values()))

    @property
    def num_unfinished_prompt_tokens(self) -> int:
        return sum(len(state.prompt_token_ids) for state in self.request_states.values())

    def take_newly_finished(self) -> list[RequestMetrics]:
        """Metrics of the requests finished since the last call (for stat loggers)."""
        finished, self._newly_finished = self._newly_finished, []
        return finished

    def engine_request_ids(self, request_ids) -> list[str]:
        """The engine-side ids behind user request ids (children of a parent), for those in flight."""
        engine_ids = []
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            children = parent.child_ids if parent else [request_id]
            engine_ids += [child for child in children if child in self.request_states]
        return engine_ids

    def abort_requests(self, request_ids) -> tuple[list[str], list[RequestOutput]]:
        """Finish the given user requests as aborted; return the engine-side ids that were in flight
        and a final output (finish reason "abort") for each of them."""
        engine_ids = self.engine_request_ids(request_ids)
        final_outputs = []
        now = time.monotonic()
        for engine_id in engine_ids:
            state = self.request_states[engine_id]
            state.finish_reason = FinishReason.ABORT
            state.detokenizer.finish(stop_terminated=False)
            output = self._make_output(state)
            if output is not None:
                final_outputs.append(output)
            self._finish(state, now)
        return engine_ids, final_outputs

    def process_outputs(
        self, engine_outputs: list[EngineCoreOutput], engine_index: int = 0
    ) -> tuple[list[RequestOutput], list[str]]:
        """Return the outputs to hand to users and the engine ids to abort (stop strings);
        ``engine_index`` is the data-parallel rank of the engine core that sent them."""
        request_outputs, to_abort = [], []
        now = time.monotonic()
        for output in engine_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            if state.metrics.engine_index != engine_index:  # (mostly the same: no write)
                state.metrics.engine_index = engine_index
            if (state.plain and output.finish_reason is None and output.new_token_ids and not output.events
                    and output.new_logprobs is None and output.new_prompt_logprobs is None
                    and output.num_cached_tokens <= state.num_cached_tokens):
                new_token_ids, sink, detokenizer = output.new_token_ids, state.text_sink, state.detokenizer
                if sink is not None and len(new_token_ids) == 1 and detokenizer.simple:
                    # the usual streamed token, as ``_plain_step`` takes it, straight to the sink
                    metrics = state.metrics
                    if metrics.first_token_time is None:
                        metrics.first_token_time = now
                    metrics.token_times.append(now)
                    text = detokenizer.add_simple(new_token_ids[0])
                    token_ids = detokenizer.token_ids
                    start, state.sent_token_offset = state.sent_token_offset, len(token_ids)
                    if start + 1 != len(token_ids):
                        new_token_ids = token_ids[start:]
                    if not sink(text, new_token_ids):
                        request_outputs.append(RequestOutput(
                            state.request_id, state.prompt, state.prompt_token_ids,
                            [CompletionOutput(state.index, text, new_token_ids)], False, state.num_cached_tokens,
                            None, state.metrics))
                    continue
                step = self._plain_step(state, new_token_ids, now)
                if step is not None:
                    text, token_ids = step
                    sink = state.text_sink
                    if sink is None or not sink(text, token_ids):
                        request_outputs.append(RequestOutput(
                            state.request_id, state.prompt, state.prompt_token_ids,
                            [CompletionOutput(state.index, text, token_ids)], False, state.num_cached_tokens,
                            None, state.metrics))
                    continue
                # a stop string ended it (the state says so): on as any other output
            else:
                self._update(state, output, now)
            if state.finish_reason is not None and not output.finished:
                to_abort.append(output.request_id)  # stopped by a stop string
            request_output = self._make_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finish_reason is not None:
                self._finish(state, now)
        return request_outputs, to_abort

    def _update(self, state: RequestState, output: EngineCoreOutput, now: float) -> None:
        metrics = state.metrics
        if output.events:
            for event in output.events:
                if event.type == EventType.SCHEDULED and metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = event.timestamp
                elif event.type == EventType.PREEMPTED:
                    metrics.num_preemptions += 1
        if output.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = output.num_cached_tokens
        if output.new_prompt_logprobs is not None:
            state.logprobs.add_prompt(output.new_prompt_logprobs)
        if output.pooling_output is not None:
            state.embedding = output.pooling_output.to_array().tolist()
            state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
            return
        new_token_ids = output.new_token_ids
        if not new_token_ids:
            if output.finished:  # finished without a token: an engine-side error
                state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
                logger.warning("request %s ended in the engine without output (%s): %s", output.request_id,
                               output.finish_reason, output.error_message)
            return
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.extend([now] * len(new_token_ids))
        stop_terminated = output.finish_reason == FinishReason.STOP and new_token_ids[-1] in state.stop_token_ids
        stop_string = state.detokenizer.update(new_token_ids, stop_terminated)
        if output.new_logprobs is not None:
            num_kept = len(state.detokenizer.token_ids) - state.logprobs.num_sampled
            state.logprobs.add_sampled(output.new_logprobs, num_kept)
        if stop_string is not None:
            state.finish_reason, state.stop_reason = FinishReason.STOP, stop_string
        elif output.finished:
            state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
            state.detokenizer.finish(stop_terminated)

    def _plain_step(self, state: RequestState, new_token_ids: list[int], now: float) -> tuple[str, list[int]] | None:
        """The common streamed step, as ``_update`` then ``_completion`` do it for an unfinished token of a plain
        request with nothing else on it: the new text and token ids to send; None when a stop string ended the
        request (its finish and stop reasons then set)."""
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        detokenizer = state.detokenizer
        if len(new_token_ids) == 1:
            metrics.token_times.append(now)
        else:
            metrics.token_times.extend([now] * len(new_token_ids))
        if detokenizer.simple and len(new_token_ids) == 1:
            text = detokenizer.add_simple(new_token_ids[0])
        else:
            stop_string = detokenizer.update(new_token_ids, False)
            if stop_string is not None:
                state.finish_reason, state.stop_reason = FinishReason.STOP, stop_string
                return None
            text = detokenizer.next_text(False, True)
        token_ids = detokenizer.token_ids
        start, state.sent_token_offset = state.sent_token_offset, len(token_ids)
        return text, token_ids[start:]

    def set_text_sink(self, request_id: str, sink: Callable[[str, list[int]], bool] | None) -> bool:
        """Offer a plain request's unfinished steps (a delta stream of its own, every token sent, no logprobs)
        to ``sink(text, token_ids)`` instead of building their ``RequestOutput``: what it takes (returns True
        for) is not returned by ``process_outputs``; anything it declines is, unchanged. The final output and
        every output with more on it (events, a stop string) never reach it. False (nothing set) for a request
        that is not plain or not in flight; None removes the sink."""
        state = self.request_states.get(request_id)
        if state is None or not state.plain:
            return False
        state.text_sink = sink
        return True

    def _finish(self, state: RequestState, now: float) -> None:
        del self.request_states[state.request_id]
        metrics = state.metrics
        metrics.finished_time = now
        metrics.num_generation_tokens = len(state.detokenizer.token_ids)
        metrics.num_cached_tokens = state.num_cached_tokens
        metrics.finish_reason = str(state.finish_reason)
        self.finished_metrics.append(metrics)
        del self.finished_metrics[:-self._max_finished_metrics]
        self._newly_finished.append(metrics)
        if state.parent is not None and state.parent.is_finished:
            self.parent_requests.pop(state.parent.request_id, None)

    def _make_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        finished = state.finish_reason is not None
        if state.is_pooling:
            if not finished:
                return None
            return PoolingRequestOutput(
                request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                outputs=EmbeddingOutput(state.embedding or []), finished=True,
                num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
                finish_reason=str(state.finish_reason))
        parent = state.parent
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if not finished and state.stream_interval > 1 and state.sent_token_offset > 0:
            # the first token goes out at once (time to first token), then every stream_interval tokens
            if len(state.detokenizer.token_ids) - state.sent_token_offset < state.stream_interval:
                return None
        completion = self._completion(state, finished)
        if parent is None:
            return self._request_output(state, [completion], finished)
        if finished:
            parent.finished[state.index] = completion
        if state.output_kind == RequestOutputKind.FINAL_ONLY:
            if not parent.is_finished:
                return None
            return self._request_output(state, [parent.finished[i] for i in sorted(parent.finished)], True)
        return self._request_output(state, [completion], parent.is_finished)

    def _completion(self, state: RequestState, finished: bool) -> CompletionOutput:
        delta = state.output_kind == RequestOutputKind.DELTA
        text = state.detokenizer.next_text(finished, delta)
        token_ids = state.detokenizer.token_ids
        start = state.sent_token_offset if delta else 0
        state.sent_token_offset = len(token_ids)
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids[start:],  # a slice: already a copy
            finish_reason=str(state.finish_reason) if finished else None,
            stop_reason=state.stop_reason,
            cumulative_logprob=state.logprobs.cumulative_logprob,
            logprobs=state.logprobs.sampled_since(start, len(token_ids)),
        )

    def _request_output(self, state: RequestState, completions: list[CompletionOutput],
                        finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=state.user_request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
            num_cached_tokens=state.num_cached_tokens, prompt_logprobs=state.logprobs.prompt,
            metrics=state.metrics,
        )
