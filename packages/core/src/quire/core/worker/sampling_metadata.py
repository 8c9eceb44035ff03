"""Gathering the sampling parameters of one step's sampling rows from the persistent batch."""

from __future__ import annotations

import numpy as np
import torch

from quire.core.worker.input_batch import InputBatch
from quire.core.worker.sampler import Penalties, SamplingMetadata

_MASK64 = (1 << 64) - 1
_NO_TOP_K = np.iinfo(np.int32).max


def step_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed from a request seed and an output position (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int) -> SamplingMetadata:
    """Sampling parameters of persistent-batch ``rows``, in that order (metadata row ``i`` = ``rows[i]``)."""
    top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
    metadata = SamplingMetadata(
        temperature=torch.from_numpy(batch.temperature[rows]),
        top_k=torch.from_numpy(np.where(top_k > 0, top_k, _NO_TOP_K).astype(np.int64))
        if (top_k > 0).any() else None,
        top_p=torch.from_numpy(top_p) if (top_p < 1).any() else None,
        min_p=torch.from_numpy(min_p) if (min_p > 0).any() else None,
    )
    num_outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    for i, row in enumerate(rows.tolist()):
        if batch.seeds[row] is not None:
            metadata.seeded_rows[i] = step_seed(batch.seeds[row], int(num_outputs[i]))
        banned = _banned_token_ids(batch, row, int(num_outputs[i]))
        if banned:
            metadata.banned_token_ids[i] = banned
        if batch.allowed_token_ids[row] is not None:
            metadata.allowed_token_ids[i] = batch.allowed_token_ids[row]
        if batch.logit_bias[row] is not None:
            metadata.logit_bias[i] = batch.logit_bias[row]
        if batch.num_logprobs[row] is not None:
            metadata.num_logprobs[i] = batch.num_logprobs[row]
    if (batch.presence_penalty[rows] != 0).any() or (batch.frequency_penalty[rows] != 0).any() or (
            batch.repetition_penalty[rows] != 1).any():
        metadata.penalties = _penalties(batch, rows, vocab_size)
    return metadata


def _banned_token_ids(batch: InputBatch, row: int, num_outputs: int) -> list[int]:
    banned = set()
    if num_outputs < batch.min_tokens[row]:
        banned.update(batch.min_tokens_blocked_ids[row])
    if batch.bad_words_token_ids[row]:
        start = batch.num_prompt_tokens[row]
        output = batch.token_ids[row, start:batch.num_tokens[row]].tolist()
        for word in batch.bad_words_token_ids[row]:
            prefix = word[:-1]
            # a bad word's last token is banned where the output so far ends with the rest of the word
            if not prefix or (len(output) >= len(prefix) and output[-len(prefix):] == prefix):
                banned.add(word[-1])
    return sorted(banned)


def _penalties(batch: InputBatch, rows: np.ndarray, vocab_size: int) -> Penalties:
    counts = np.zeros((len(rows), vocab_size), dtype=np.float32)
    seen = np.zeros((len(rows), vocab_size), dtype=bool)
    for i, row in enumerate(rows.tolist()):
        prompt_len, num_tokens = batch.num_prompt_tokens[row], batch.num_tokens[row]
        output = batch.token_ids[row, prompt_len:num_tokens]
        counts[i] = np.bincount(output, minlength=vocab_size)[:vocab_size]
        seen[i, batch.token_ids[row, :num_tokens]] = True
    return Penalties(
        presence=torch.from_numpy(batch.presence_penalty[rows]),
        frequency=torch.from_numpy(batch.frequency_penalty[rows]),
        repetition=torch.from_numpy(batch.repetition_penalty[rows]),
        output_counts=torch.from_numpy(counts),
        seen=torch.from_numpy(seen),
    )
