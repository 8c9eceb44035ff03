"""Messages between the front end and the engine core (msgspec structs; no torch, no pickles).

Structs are array-like, so fields are positional on the wire: append new fields at the end.
"""

from __future__ import annotations

import enum

import msgspec

from quire.core.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A validated, tokenized request, as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] = []


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of consecutive positions. Row ``i`` lists the chosen token first (the sampled token,
    or the actual prompt token), then the top-k tokens; ``ranks[i]`` is the chosen token's rank
    (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """Something that happened to a request in the engine, at ``time.monotonic()`` ``timestamp``."""

    type: EventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one engine step (incremental: only the new token ids)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    events: list[EngineCoreEvent] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A snapshot of the scheduler after one step (counters are cumulative)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
