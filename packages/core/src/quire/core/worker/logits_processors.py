"""The sampler's logits-processor step: an ordered pipeline of per-request masks and biases.

It runs after the raw logprobs are taken and before penalties, temperature, min-p and top-k/top-p, so a
processor's mask holds whatever sampling follows. The built-in members, in order: the structured-output
grammar bitmask, allowed token ids, banned token ids (bad words and min-tokens masking), logit bias.
Speculative verification joins by adding a processor, not by editing the sampler.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quire.core.worker.sampler import SamplingMetadata


class LogitsProcessor(abc.ABC):
    """One step of the pipeline.

    ``is_active(metadata)`` says whether any row of this step needs the processor; it must be cheap (it is
    asked every step, also to decide whether the step can take the plain-greedy fast path) and an inactive
    processor is not applied. ``apply(logits, metadata)`` gets float32 CPU logits ``[B, vocab]`` (row ``i``
    is ``metadata`` row ``i``), may change them in place, and returns the logits to go on with. Per-step
    inputs come from ``metadata``: its named fields, or ``metadata.processor_inputs[key]`` for data a new
    processor brings (see ``SamplingMetadata``).
    """

    @abc.abstractmethod
    def is_active(self, metadata: SamplingMetadata) -> bool: ...

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor: ...


GRAMMAR_BITMASK = "grammar_bitmask"
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarBitmask(LogitsProcessor):
    """Structured outputs: each constrained row keeps only the tokens its grammar allows next.

    Input ``processor_inputs["grammar_bitmask"]``: ``(rows, bitmask)``, the logits rows (int64 ``[k]``) and
    their int32 bitmask rows ``[k, ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32``: token ``t``).
    """

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return GRAMMAR_BITMASK in metadata.processor_inputs

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        rows, bitmask = metadata.processor_inputs[GRAMMAR_BITMASK]
        allowed = unpack_bitmask(bitmask, logits.shape[-1])
        logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
        return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[k, words]`` bitmask -> bool ``[k, vocab_size]`` (True: allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


class AllowedTokenIds(LogitsProcessor):
    """Rows with ``allowed_token_ids`` keep only those tokens' logits."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return bool(metadata.allowed_token_ids)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        for row, token_ids in metadata.allowed_token_ids.items():
            keep = logits[row, token_ids]
            logits[row] = float("-inf")
            logits[row, token_ids] = keep
        return logits


class BannedTokenIds(LogitsProcessor):
    """Bans a row's ``banned_token_ids`` (the next token of a bad word; stop and EOS ids before
    ``min_tokens``)."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return bool(metadata.banned_token_ids)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        for row, token_ids in metadata.banned_token_ids.items():
            logits[row, token_ids] = float("-inf")
        return logits


class LogitBias(LogitsProcessor):
    """Adds each row's ``logit_bias`` to its tokens' logits."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return bool(metadata.logit_bias)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        for row, (token_ids, biases) in metadata.logit_bias.items():
            logits[row, token_ids] += torch.tensor(biases, dtype=logits.dtype)
        return logits


class LogitsProcessorPipeline:
    """Processors applied in order; ``append`` adds one at the end (after the built-in members)."""

    def __init__(self, processors: Iterable[LogitsProcessor]):
        self.processors = list(processors)

    def append(self, processor: LogitsProcessor) -> None:
        self.processors.append(processor)

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return any(processor.is_active(metadata) for processor in self.processors)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        for processor in self.processors:
            if processor.is_active(metadata):
                logits = processor.apply(logits, metadata)
        return logits


def default_logits_processors() -> LogitsProcessorPipeline:
    """The built-in pipeline, in the order the sampler documents."""
    return LogitsProcessorPipeline([GrammarBitmask(), AllowedTokenIds(), BannedTokenIds(), LogitBias()])
