"""Turning logits into tokens: masking, temperature, min-p, top-k/top-p, then sampling.

Greedy rows take the argmax. Random rows race exponential noise (``argmax(p / q)`` with ``q ~ Exp(1)``,
which samples from ``p``). A row with a seed draws its noise from a generator seeded by
``(seed, output position)``, so its tokens depend on neither the batch it runs in nor preemptions.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from quire.core.sampling_params import GREEDY_TEMPERATURE

_MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the rows that sample in this step."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor | None  # [B] int64, vocabulary size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [B] float32; None if no row uses it
    min_p: torch.Tensor | None  # [B] float32; None if no row uses it
    seeded_rows: dict[int, int]  # row -> seed for this step's noise
    blocked_token_ids: dict[int, list[int]]  # row -> ids masked out (min_tokens not reached)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature < GREEDY_TEMPERATURE).all())


def step_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed from a request seed and an output position (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Samples one token per row; unseeded random rows use the runner's generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        for row, token_ids in metadata.blocked_token_ids.items():
            logits[row, token_ids] = float("-inf")
        greedy = logits.argmax(dim=-1)
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
            row_generator = torch.Generator().manual_seed(seed)
            noise[row].exponential_(generator=row_generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)


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


def build_sampling_metadata(batch, rows: np.ndarray) -> SamplingMetadata:
    """Gather the sampling parameters of ``rows`` of an ``InputBatch``."""
    top_k = batch.top_k[rows]
    top_p = batch.top_p[rows]
    min_p = batch.min_p[rows]
    seeded, blocked = {}, {}
    num_outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    for i, row in enumerate(rows.tolist()):
        seed = batch.seeds[row]
        if seed is not None:
            seeded[i] = step_seed(seed, int(num_outputs[i]))
        if num_outputs[i] < batch.min_tokens[row] and batch.min_tokens_blocked_ids[row]:
            blocked[i] = batch.min_tokens_blocked_ids[row]
    vocab_cap = np.iinfo(np.int32).max
    return SamplingMetadata(
        temperature=torch.from_numpy(batch.temperature[rows]),
        top_k=(torch.from_numpy(np.where(top_k > 0, top_k, vocab_cap).astype(np.int64))
               if (top_k > 0).any() else None),
        top_p=torch.from_numpy(top_p) if (top_p < 1).any() else None,
        min_p=torch.from_numpy(min_p) if (min_p > 0).any() else None,
        seeded_rows=seeded,
        blocked_token_ids=blocked,
    )
