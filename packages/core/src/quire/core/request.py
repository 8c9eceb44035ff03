"""A request's life inside the engine core: one class with one ordered status enum (no torch here)."""

from __future__ import annotations

import enum
import time

from quire.core.lora.request import LoRARequest
from quire.core.pooling_params import PoolingParams
from quire.core.sampling_params import SamplingParams
from quire.core.wire import EngineCoreEvent, EventType, FinishReason, MultiModalFeature


class RequestStatus(enum.IntEnum):
    """Ordered: every status after ``PREEMPTED`` is a finished one."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # its structured-output constraint is still compiling
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    FINISHED_QUEUE_TIMEOUT = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_QUEUE_TIMEOUT: FinishReason.QUEUE_TIMEOUT,
}


class Request:
    """Token ids, progress and status of one request as the scheduler sees it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        bad_words_token_ids: list[list[int]] = (),
        mm_features: list[MultiModalFeature] | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.bad_words_token_ids = [list(ids) for ids in bad_words_token_ids]
        # Images of the prompt, in prompt order: their placeholder tokens take the encoder's outputs.
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())
        self.arrival_time = arrival_time
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.priority = priority
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Prefix caching: chained hashes of the full blocks so far, and the salt of the first block.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        # Prompt logprobs need logits for every prompt token, so such requests compute them all.
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        self.num_cached_tokens: int | None = None  # prefix-cache hit when first scheduled
        self.events: list[EngineCoreEvent] = []  # not yet reported to the front end
        # A StructuredOutputRequest (quire.core.structured_outputs.manager) when the output is constrained.
        self.structured_output = None
        self.error_message: str | None = None  # why a FINISHED_ERROR request failed
        # Speculative decoding: tokens proposed to follow ``all_token_ids``, verified in the next step.
        self.spec_token_ids: list[int] = []
        # A pooling request: pooled (and finished) once its prompt is computed; it samples nothing.
        self.pooling_params = pooling_params

    def record_event(self, event_type: EventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.monotonic()))

    def take_events(self) -> list[EngineCoreEvent] | None:
        events, self.events = self.events, []
        return events or None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
