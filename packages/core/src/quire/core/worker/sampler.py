"""Turning logits into tokens.

Order (as in vLLM): raw logprobs (if asked) → the logits processors (``logits_processors``: the
structured-output grammar bitmask → allowed token ids → bad words and min-tokens masking → logit bias →
any added processor) → repetition, frequency and presence penalties → greedy argmax → temperature →
min-p → top-k / top-p → sample. Random rows race
exponential noise (``argmax(p / q)`` with ``q ~ Exp(1)``, which samples from ``p``); a row with a seed
draws its noise from a generator seeded by ``(seed, output position)``, so its tokens depend neither on
the batch it runs in nor on preemptions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from quire.core.sampling_params import GREEDY_TEMPERATURE
from quire.core.wire import Logprobs
from quire.core.worker.logits_processors import LogitsProcessorPipeline, default_logits_processors
from quire.kernels.sampling import argmax


@dataclasses.dataclass
class Penalties:
    """Penalty parameters and token statistics of every sampling row (used when any row has one)."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    output_counts: torch.Tensor  # [B, V] float32: occurrences in the output so far
    seen: torch.Tensor  # [B, V] bool: in the prompt or the output


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the rows that sample in this step (row ``i`` = logits row ``i``).

    ``processor_inputs`` carries per-step data of logits processors that have no field here, by a key
    each processor documents: e.g. a grammar bitmask built by the engine core (``[B, ceil(vocab / 32)]``
    int32, one bit per allowed token) under its processor's key. Empty when no such processor has input.
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor | None = None  # [B] int64, a huge value where disabled; None if no row uses it
    top_p: torch.Tensor | None = None  # [B] float32; None if no row uses it
    min_p: torch.Tensor | None = None  # [B] float32; None if no row uses it
    seeded_rows: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> this step's seed
    allowed_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    banned_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # bad words, min_tokens
    logit_bias: dict[int, tuple[list[int], list[float]]] = dataclasses.field(default_factory=dict)
    penalties: Penalties | None = None
    num_logprobs: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> k (-1: vocabulary)
    processor_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature < GREEDY_TEMPERATURE).all())


@dataclasses.dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: dict[int, Logprobs]  # row -> logprobs of its sampled token (rows that asked)


class Sampler:
    """Samples one token per row; unseeded random rows use the runner's generator.

    ``logits_processors`` (by default the built-in pipeline) may be given, or appended to, to add a step.
    """

    def __init__(self, generator: torch.Generator, logits_processors: LogitsProcessorPipeline | None = None):
        self.generator = generator
        self.logits_processors = default_logits_processors() if logits_processors is None else logits_processors

    def is_plain_greedy(self, metadata: SamplingMetadata) -> bool:
        """Every row takes its most likely token and nothing changes the logits or asks for logprobs."""
        return (metadata.all_greedy and not metadata.num_logprobs and metadata.penalties is None
                and not self.logits_processors.is_active(metadata))

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` are ``[B, vocab]`` in the model's dtype (float32 is used from here on, except by a
        plain greedy step, whose argmax is the same in either)."""
        if self.is_plain_greedy(metadata):
            return SamplerOutput(argmax(logits), {})
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.num_logprobs else None
        logits = self.logits_processors.apply(logits, metadata)
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        tokens = self._sample(logits, metadata)
        logprobs = {}
        if raw_logprobs is not None:
            for row, k in metadata.num_logprobs.items():
                logprobs[row] = gather_logprobs(raw_logprobs[row:row + 1], tokens[row:row + 1], k)
        return SamplerOutput(tokens, logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = argmax(logits)
        if metadata.all_greedy:
            return greedy
        is_greedy = metadata.temperature < GREEDY_TEMPERATURE
        temperature = torch.where(is_greedy, torch.ones_like(metadata.temperature), metadata.temperature)
        logits = logits / temperature[:, None]
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in metadata.seeded_rows.items():
            noise[row].exponential_(generator=torch.Generator().manual_seed(seed))
        sampled = argmax(probs / noise)
        return torch.where(is_greedy, greedy, sampled)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty on every seen token, then frequency and presence penalties on output tokens."""
    repetition = penalties.repetition[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(penalties.seen, penalized, logits)
    logits = logits - penalties.frequency[:, None] * penalties.output_counts
    return logits - penalties.presence[:, None] * (penalties.output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the ``top_k`` largest logits, then the smallest set whose probability reaches ``top_p``."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_index = (vocab_size - top_k).clamp(min=0)[:, None]
        kth_value = sorted_logits.gather(-1, kth_index)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> Logprobs:
    """Rows of ``[chosen token, top-k tokens]`` logprobs, and the chosen tokens' ranks.

    ``logprobs`` is ``[N, V]`` (log-softmaxed), ``chosen`` ``[N]``; ``k=-1`` means the whole vocabulary.
    """
    k = logprobs.shape[-1] if k < 0 else min(k, logprobs.shape[-1])
    chosen_logprobs = logprobs.gather(-1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return Logprobs.from_arrays(
        torch.cat([chosen[:, None], top_ids], dim=-1).numpy(),
        torch.cat([chosen_logprobs, top_logprobs], dim=-1).numpy(),
        ranks.numpy(),
    )
