"""The two plain-data seams between the scheduler and the model runner."""

from __future__ import annotations

import dataclasses
from typing import Any

from quire.core.lora.request import LoRARequest
from quire.core.pooling_params import PoolingParams
from quire.core.sampling_params import SamplingParams
from quire.core.wire import Logprobs, MultiModalFeature


@dataclasses.dataclass
class NewRequestData:
    """A request the runner has not seen yet (or is seeing again after a preemption)."""

    request_id: str
    token_ids: list[int]  # prompt, plus already generated tokens for a resumed request
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    block_ids: list[int]
    num_computed_tokens: int
    mm_features: list[MultiModalFeature] = dataclasses.field(default_factory=list)  # the prompt's images
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request: pooled once its prompt is computed


@dataclasses.dataclass
class CachedRequestData:
    """A request the runner already holds: its new blocks and where its computation stands."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Sliding windows: how many leading entries of the request's block table it no longer holds (released to
    # the pool, wholly before every layer's window); the runner points them at the null block.
    num_released_blocks: int = 0


@dataclasses.dataclass
class SchedulerOutput:
    """What to compute in one step: ``num_scheduled_tokens[request_id]`` tokens per request."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    # Requests that finished or were preempted since the previous step: the runner drops their state.
    finished_request_ids: set[str]
    # Structured outputs: the ids of the constrained requests that sample in this step, and their rows of
    # the token bitmask (int32 ``[len(ids), ceil(vocab / 32)]``, one bit per allowed token); None if none.
    grammar_bitmask: tuple[list[str], Any] | None = None
    # Multimodal items: per request, the indices (into its ``mm_features``) of the items whose encoder runs
    # in this step, and the identifiers of encoder outputs the runner may drop (before encoding).
    scheduled_encoder_inputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    freed_encoder_identifiers: list[str] = dataclasses.field(default_factory=list)
    # Speculative decoding: the proposed tokens each request verifies in this step (after its last known
    # token; they are counted in its ``num_scheduled_tokens``).
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclasses.dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests whose scheduled tokens reached their end, and the
    logprobs asked for: of the sampled tokens, and of the prompt tokens this step's chunk predicted."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, Logprobs] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = dataclasses.field(default_factory=dict)
    # Pooling requests whose prompt this step completed: their vectors (numpy float32, 1-D).
    pooled: dict[str, Any] = dataclasses.field(default_factory=dict)
