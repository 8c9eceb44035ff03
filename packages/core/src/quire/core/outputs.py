"""What front ends hand to users: ``RequestOutput`` with one ``CompletionOutput`` per sequence."""

from __future__ import annotations

import dataclasses

from quire.core.wire import SchedulerStats


@dataclasses.dataclass
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class RequestMetrics:
    """Timings of one request, in ``time.monotonic()`` seconds (engine events and front-end arrivals)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per generated token
    finished_time: float | None = None
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    structured_output_backend: str | None = None  # the grammar library of a constrained request
    # The data-parallel rank of the engine core that ran it: the one its outputs came from (before any
    # did, the rank it was pinned to, else 0).
    engine_index: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence. ``stop_reason`` is the stop string or stop token id that ended it,
    or None (EOS, length, abort). ``logprobs`` has one entry per token in ``token_ids`` when asked."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # LLM.chat with a reasoning parser or tools: the text split into the answer outside tool calls, the
    # thinking and the calls (``quire.core.parsers``); None where not parsed.
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's prompt and its output(s) so far (or the new part, in delta mode).

    ``prompt_logprobs`` (when asked) has one entry per prompt token, the first being None.
    ``num_cached_tokens`` is how many prompt tokens came from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    """A pooling request's vector (float32 values as Python floats)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class PoolingRequestOutput:
    """What a pooling (embedding) request returns: one output, when it has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    finish_reason: str | None = "stop"  # "abort" (an empty vector), "error" or "queue_timeout" otherwise


@dataclasses.dataclass
class ScoringOutput:
    """The similarity of two texts: the cosine of their embeddings."""

    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """``LLM.score``'s answer for one pair: the score and the token ids of both sides."""

    request_id: str
    prompt_token_ids: list[int]  # the first text's, then the second's
    outputs: ScoringOutput
    finished: bool = True


@dataclasses.dataclass
class EngineMetrics:
    """The latest scheduler statistics and the timings of recently finished requests."""

    scheduler: SchedulerStats | None
    finished_requests: list[RequestMetrics]
