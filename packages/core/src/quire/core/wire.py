"""Messages between the front end and the engine core (msgspec structs; no torch, no pickles).

Structs are array-like, so fields are positional on the wire: append new fields at the end.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from quire.core.lora.request import LoRARequest
from quire.core.pooling_params import PoolingParams
from quire.core.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    QUEUE_TIMEOUT = 4  # waited longer than max_queue_time before it started; the caller may retry

    def __str__(self) -> str:
        return self.name.lower()


class TensorData(msgspec.Struct, array_like=True, gc=False):
    """A tensor as a raw little-endian buffer (no pickles on the wire): numpy ``dtype`` name and shape."""

    dtype: str
    shape: list[int]
    buffer: bytes

    @classmethod
    def from_array(cls, array) -> TensorData:
        """From a numpy array (or anything ``numpy.asarray`` takes, such as a CPU torch tensor)."""
        import numpy as np

        array = np.asarray(array)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return cls(array.dtype.name, list(array.shape), np.ascontiguousarray(array).tobytes())

    def to_array(self):
        """A read-only numpy view of the buffer."""
        import numpy as np

        return np.frombuffer(self.buffer, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One image (or other item) of a prompt, processed by the front end for the model's encoder.

    ``offset`` is the index of the first of the ``length`` placeholder tokens the item's embeddings
    replace in the prompt; ``identifier`` is a hash of the item's content and processing, which keys the
    engine's encoder-output cache and enters the prefix-cache hashes of the blocks the placeholders
    occupy. ``data`` holds the processor's outputs for this item alone (``pixel_values``, and for some
    models ``image_grid_thw``).
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, TensorData] = {}


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
    # With a structured-output constraint and a reasoning parser: the token ids of the parser's start and end
    # tags (the constraint waits for the reasoning to end); None otherwise.
    reasoning_tags: tuple[list[int], list[int]] | None = None
    # Images of the prompt, in prompt order (None for text-only prompts).
    mm_features: list[MultiModalFeature] | None = None
    # With several engine cores: the one that must run this request (None: the least loaded).
    data_parallel_rank: int | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # A pooling (embedding) request: its prompt runs once and returns one vector, nothing is sampled
    # (``sampling_params`` is then a placeholder of one token that is never generated).
    pooling_params: PoolingParams | None = None


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of consecutive positions, as raw little-endian buffers (no pickles on the wire).

    Row ``i`` lists the chosen token first (the sampled token, or the actual prompt token), then the
    top-k tokens: ``token_ids`` int32 and ``logprobs`` float32, both ``[num_rows, num_cols]``;
    ``ranks`` int32 ``[num_rows]`` is the chosen token's rank (1 = most likely).
    """

    num_rows: int
    num_cols: int
    token_ids_buffer: bytes
    logprobs_buffer: bytes
    ranks_buffer: bytes

    @classmethod
    def from_arrays(cls, token_ids, logprobs, ranks) -> Logprobs:
        """Build from numpy arrays (any integer / float dtypes)."""
        import numpy as np

        token_ids = np.ascontiguousarray(token_ids, dtype="<i4")
        return cls(token_ids.shape[0], token_ids.shape[1], token_ids.tobytes(),
                   np.ascontiguousarray(logprobs, dtype="<f4").tobytes(),
                   np.ascontiguousarray(ranks, dtype="<i4").tobytes())

    @property
    def token_ids(self):
        import numpy as np

        return np.frombuffer(self.token_ids_buffer, dtype="<i4").reshape(self.num_rows, self.num_cols)

    @property
    def logprobs(self):
        import numpy as np

        return np.frombuffer(self.logprobs_buffer, dtype="<f4").reshape(self.num_rows, self.num_cols)

    @property
    def ranks(self):
        import numpy as np

        return np.frombuffer(self.ranks_buffer, dtype="<i4")


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
    error_message: str | None = None  # with FinishReason.ERROR: why the engine failed this request
    pooling_output: TensorData | None = None  # a finished pooling request's vector (float32)

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
    # Seconds each structured-output grammar compiled since the previous snapshot took (cache misses only).
    structured_output_compile_seconds: list[float] = []
    mm_cache_queries: int = 0  # multimodal items whose encoder output was needed
    mm_cache_hits: int = 0  # items whose encoder output was already in the encoder cache
    # Speculative decoding: verification steps, proposed and accepted tokens, accepted tokens per position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # LoRA (max_loras 0: off): the adapters of the running and of the waiting requests, by name.
    max_loras: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a utility call: a result, or why it failed."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced (or the answer to one utility call)."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    engine_index: int = 0  # the data-parallel rank of the engine core that sent this
    # Never sent by an engine: a data-parallel client fills it in, beside the sender's own
    # ``scheduler_stats``, with the whole group's statistics (each engine's latest snapshot combined).
    group_scheduler_stats: SchedulerStats | None = None


class RequestType(bytes, enum.Enum):
    """The one-byte first frame of every message to the engine core process."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list of request ids
    UTILITY = b"\x02"  # payload: UtilityCall
    SHUTDOWN = b"\x03"  # payload: empty; an engine core elsewhere (no signal reaches it) stops as on SIGTERM


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """A call of one of the engine core's utility methods (a fixed list, nothing arbitrary)."""

    call_id: int
    method: str
    args: list[Any] = []


class EngineReady(msgspec.Struct, array_like=True, tag=True, gc=False):
    """The engine core's first message once it has started: its real limits."""

    max_model_len: int
    num_blocks: int
    block_size: int


class EngineRegistration(msgspec.Struct, array_like=True, tag=True, gc=False):
    """A headless launcher's request for where engine core ``rank`` of a ``data_parallel_size`` group must
    connect (sent to the front end's RPC port)."""

    rank: int
    data_parallel_size: int


class EngineAssignment(msgspec.Struct, array_like=True, tag=True, gc=False):
    """The front end's answer to an ``EngineRegistration``: the engine core's input and output addresses, or
    why the rank was refused."""

    input_address: str = ""
    output_address: str = ""
    refusal: str | None = None


class EngineStartupFailure(msgspec.Struct, array_like=True, tag=True, gc=False):
    """The engine core's first message when it could not start, with the cause."""

    error_type: str
    message: str


# A single-frame message the engine core sends when it dies of an error.
ENGINE_DEAD_SENTINEL = b"QUIRE_ENGINE_CORE_DEAD"
