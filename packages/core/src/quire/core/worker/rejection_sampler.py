"""Speculative decoding's rejection sampler: which draft tokens the target model keeps, and the token after.

A row proposes ``k`` draft tokens ``d_1 .. d_k``; the target model scores ``k + 1`` positions in one step,
position ``j`` holding the target's distribution ``p_j`` of the token after the prompt, the output so far and
``d_1 .. d_(j-1)``. Walking the positions in order:

- a greedy row keeps ``d_j`` while it is the target's argmax at ``j``; at the first mismatch it outputs that
  argmax and stops. A row that keeps all ``k`` outputs the argmax at ``k + 1`` too (the bonus token).
- a random row keeps ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``, ``q_j`` being the distribution
  the draft was drawn from; at the first rejection it draws a replacement from ``max(p_j - q_j, 0)``
  (renormalised) and stops; a row that keeps all ``k`` draws the bonus token from ``p_(k+1)``. A proposer
  without probabilities (n-gram lookup) is a ``q_j`` that is one-hot on ``d_j``.

Why a random row's tokens follow the target exactly: at one position, with ``d ~ q``, a token ``x`` comes out
either as an accepted draft, with probability ``q(x) * min(1, p(x) / q(x)) = min(p(x), q(x))``, or as a
replacement after a rejection. A rejection happens with probability ``1 - sum(min(p, q)) = sum(max(p - q, 0))``,
which is exactly the mass the replacement distribution is normalised by, so the replacement path contributes
``max(p(x) - q(x), 0)``; and ``min(p, q) + max(p - q, 0) = p``. (One-hot ``q``: ``d`` comes out with
probability ``p(d)``, any other ``x`` with ``(1 - p(d)) * p(x) / (1 - p(d)) = p(x)``, whatever ``d`` was.)
Every position that is reached has only accepted tokens before it, so the ``p_j`` the target computed from the
drafts is the distribution given the real prefix; stopping at the first rejection discards the positions
whose prefix turned out false. Hence each output token is drawn from the target's conditional distribution,
and a step emits between 1 and ``k + 1`` tokens.

``p_j`` is the target after the normal sampler's temperature, min-p and top-k / top-p (its own functions);
draws race exponential noise like it, so a row with ``k = 0`` samples exactly as the normal sampler would. A
seeded row draws the acceptance uniform and then, if needed, the noise of output position ``n`` from a
generator seeded by ``(seed, n)``, so its tokens depend neither on the batch nor on the row's place in it.

Flat layout of one step (``B`` rows, row ``i`` with ``k_i`` drafts)::

    target_logits    [sum(k_i + 1), V]  row 0: k_0 draft positions, bonus | row 1: ...
    draft_token_ids  [sum(k_i)]         row 0: d_1 .. d_k0                 | row 1: ...
    draft_probs      [sum(k_i), V]      q_j of each draft token (None for a proposer without probabilities)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from quire.core.sampling_params import GREEDY_TEMPERATURE
from quire.core.worker.sampler import SamplingMetadata, apply_min_p, apply_top_k_top_p
from quire.core.worker.sampling_metadata import step_seed
from quire.kernels.sampling import argmax


@dataclasses.dataclass
class RejectionSamplerOutput:
    token_ids: torch.Tensor  # [B, max_k + 1] int64: row i's kept drafts, then one more token; -1 pads
    num_accepted: torch.Tensor  # [B] int64: kept draft tokens (row i outputs num_accepted[i] + 1 tokens)
    # [B, max_k + 1] float32: raw target logprob of each output token, NaN pads (None unless asked for)
    logprobs: torch.Tensor | None = None


@dataclasses.dataclass
class _Layout:
    """Where each row's positions lie in the flat tensors (``D`` draft tokens in all)."""

    num_draft_tokens: torch.Tensor  # [B] int64
    target_starts: torch.Tensor  # [B]: the row's first position in target_logits
    draft_starts: torch.Tensor  # [B]: the row's first draft token
    draft_rows: torch.Tensor  # [D]: the row of each draft token
    draft_positions: torch.Tensor  # [D]: its position j in the row (0-based)
    draft_target_index: torch.Tensor  # [D]: the target position that scores it

    @property
    def max_num_draft_tokens(self) -> int:
        return int(self.num_draft_tokens.max()) if len(self.num_draft_tokens) else 0


class RejectionSampler:
    """Verifies draft tokens against the target model; unseeded random rows use the runner's generator.

    ``metadata`` has one row per request (``B`` rows), as for the normal sampler; only its temperature,
    min-p, top-k and top-p are read. NOTE: logits processors and penalties are the caller's: each target
    position must already have them applied as if the drafts before it were output.
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                 num_draft_tokens: Sequence[int] | torch.Tensor, metadata: SamplingMetadata,
                 draft_probs: torch.Tensor | None = None,
                 seeds: dict[int, tuple[int, int]] | None = None,
                 output_logprobs: bool = False) -> RejectionSamplerOutput:
        """``seeds`` maps a seeded row to ``(request seed, output position of its first target position)``;
        every row in ``metadata.seeded_rows`` must be there. ``output_logprobs``: also the raw target logprob
        of each output token (a log-softmax normaliser per position: skipped unless asked for)."""
        seeds = seeds or {}
        layout = _layout(num_draft_tokens, target_logits.device)
        _validate(target_logits, draft_token_ids, draft_probs, metadata, seeds, layout)
        target_logits = target_logits.float()
        greedy_tokens = argmax(target_logits)
        is_greedy = metadata.temperature.to(target_logits.device) < GREEDY_TEMPERATURE
        accepted = greedy_tokens[layout.draft_target_index] == draft_token_ids
        if not metadata.all_greedy:
            target_probs = _target_probs(target_logits, metadata, layout)
            uniforms = self._uniforms(layout, seeds)
            random_accepted = _random_acceptance(target_probs, draft_token_ids, draft_probs, uniforms, layout)
            accepted = torch.where(is_greedy[layout.draft_rows], accepted, random_accepted)
        num_accepted = _count_accepted(accepted, layout)
        final_tokens = greedy_tokens[layout.target_starts + num_accepted]
        if not metadata.all_greedy:
            sampled = self._sample_final(target_probs, draft_token_ids, draft_probs, num_accepted, layout, seeds)
            final_tokens = torch.where(is_greedy, final_tokens, sampled)
        token_ids = _output_tokens(draft_token_ids, final_tokens, num_accepted, layout)
        logprobs = _output_logprobs(target_logits, token_ids, layout) if output_logprobs else None
        return RejectionSamplerOutput(token_ids, num_accepted, logprobs)

    def _uniforms(self, layout: _Layout, seeds: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One acceptance uniform per draft token; a seeded row's is the first draw of its position."""
        device = layout.draft_rows.device
        uniforms = torch.rand(len(layout.draft_rows), generator=self.generator, device=device)
        for row, (seed, first_position) in seeds.items():
            start = int(layout.draft_starts[row])
            for j in range(int(layout.num_draft_tokens[row])):
                generator = _position_generator(seed, first_position + j, device)
                uniforms[start + j] = torch.rand(1, generator=generator, device=device)[0]
        return uniforms

    def _sample_final(self, target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                      draft_probs: torch.Tensor | None, num_accepted: torch.Tensor, layout: _Layout,
                      seeds: dict[int, tuple[int, int]]) -> torch.Tensor:
        """Each row's last token: a replacement after a rejection, else the bonus token."""
        probs = target_probs[layout.target_starts + num_accepted]
        is_rejected = num_accepted < layout.num_draft_tokens
        if bool(is_rejected.any()):
            rejected_index = (layout.draft_starts + num_accepted).clamp(max=len(draft_token_ids) - 1)
            if draft_probs is None:
                rejected_probs = torch.zeros_like(probs)
                rejected_probs.scatter_(-1, draft_token_ids[rejected_index][:, None], 1.0)
            else:
                rejected_probs = draft_probs[rejected_index].float()
            residual = _residual_probs(probs, rejected_probs)
            # NOTE: a rejection implies p(d) < q(d), so the residual has mass; rounding aside, keep p if not
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
            probs = torch.where(is_rejected[:, None], residual, probs)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        num_accepted_list, is_rejected_list = num_accepted.tolist(), is_rejected.tolist()
        for row, (seed, first_position) in seeds.items():
            generator = _position_generator(seed, first_position + num_accepted_list[row], probs.device)
            if is_rejected_list[row]:
                torch.rand(1, generator=generator, device=probs.device)  # this position's acceptance uniform
            noise[row].exponential_(generator=generator)
        # racing Exp(1) noise samples in proportion to the unnormalised weights
        return argmax(probs / noise)


def _residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(p - q, 0)``, unnormalised: what a rejected position draws its replacement from."""
    return (target_probs - draft_probs).clamp(min=0)


def _position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(step_seed(seed, position))


def _layout(num_draft_tokens: Sequence[int] | torch.Tensor, device: torch.device) -> _Layout:
    counts = torch.as_tensor(num_draft_tokens, dtype=torch.int64, device=device)
    rows = torch.arange(len(counts), device=device)
    target_starts = (counts + 1).cumsum(0) - (counts + 1)
    draft_starts = counts.cumsum(0) - counts
    draft_rows = rows.repeat_interleave(counts)
    draft_positions = torch.arange(len(draft_rows), device=device) - draft_starts[draft_rows]
    return _Layout(counts, target_starts, draft_starts, draft_rows, draft_positions,
                   target_starts[draft_rows] + draft_positions)


def _validate(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
              metadata: SamplingMetadata, seeds: dict[int, tuple[int, int]], layout: _Layout) -> None:
    num_rows, num_drafts = len(layout.num_draft_tokens), len(layout.draft_rows)
    if bool((layout.num_draft_tokens < 0).any()):
        raise ValueError("num_draft_tokens must not be negative")
    if target_logits.dim() != 2 or target_logits.shape[0] != num_rows + num_drafts:
        raise ValueError(f"target_logits must be [sum(num_draft_tokens + 1), vocab] = [{num_rows + num_drafts}, "
                         f"vocab], got {list(target_logits.shape)}")
    if draft_token_ids.shape != (num_drafts,):
        raise ValueError(f"draft_token_ids must be [sum(num_draft_tokens)] = [{num_drafts}], "
                         f"got {list(draft_token_ids.shape)}")
    if draft_probs is not None and draft_probs.shape != (num_drafts, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [{num_drafts}, {target_logits.shape[1]}], "
                         f"got {list(draft_probs.shape)}")
    if metadata.temperature.shape != (num_rows,):
        raise ValueError(f"metadata.temperature must have one value per row ({num_rows})")
    missing = sorted(set(metadata.seeded_rows) - set(seeds))
    if missing:
        raise ValueError(f"seeds must give (seed, first output position) for the seeded rows {missing}")


def _target_probs(target_logits: torch.Tensor, metadata: SamplingMetadata, layout: _Layout) -> torch.Tensor:
    """``p_j`` at every target position: each row's temperature, min-p, top-k and top-p, as when sampling."""
    positions_per_row = layout.num_draft_tokens + 1

    def per_position(values: torch.Tensor) -> torch.Tensor:
        return values.to(target_logits.device).repeat_interleave(positions_per_row)

    temperature = per_position(metadata.temperature)
    temperature = torch.where(temperature < GREEDY_TEMPERATURE, torch.ones_like(temperature), temperature)
    logits = target_logits / temperature[:, None]
    if metadata.min_p is not None:
        logits = apply_min_p(logits, per_position(metadata.min_p))
    if metadata.top_k is not None or metadata.top_p is not None:
        top_k = None if metadata.top_k is None else per_position(metadata.top_k)
        top_p = None if metadata.top_p is None else per_position(metadata.top_p)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def _random_acceptance(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                       draft_probs: torch.Tensor | None, uniforms: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Keep ``d`` when ``u < p(d) / q(d)``, written ``u * q(d) < p(d)`` so that ``q(d) = 0`` cannot divide."""
    target_draft_probs = target_probs[layout.draft_target_index, draft_token_ids]
    if draft_probs is None:
        return uniforms < target_draft_probs
    draft_draft_probs = draft_probs.float().gather(-1, draft_token_ids[:, None])[:, 0]
    return uniforms * draft_draft_probs < target_draft_probs


def _count_accepted(accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Per row, the number of drafts kept before the first rejection."""
    padded = torch.zeros(len(layout.num_draft_tokens), layout.max_num_draft_tokens, dtype=torch.int64,
                         device=accepted.device)
    padded[layout.draft_rows, layout.draft_positions] = accepted.long()
    return padded.cumprod(dim=1).sum(dim=1)


def _output_tokens(draft_token_ids: torch.Tensor, final_tokens: torch.Tensor, num_accepted: torch.Tensor,
                   layout: _Layout) -> torch.Tensor:
    num_rows = len(layout.num_draft_tokens)
    token_ids = torch.full((num_rows, layout.max_num_draft_tokens + 1), -1, dtype=torch.int64,
                           device=final_tokens.device)
    is_kept = layout.draft_positions < num_accepted[layout.draft_rows]
    token_ids[layout.draft_rows, layout.draft_positions] = torch.where(is_kept, draft_token_ids, -1)
    token_ids[torch.arange(num_rows, device=final_tokens.device), num_accepted] = final_tokens
    return token_ids


def _output_logprobs(target_logits: torch.Tensor, token_ids: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The log-softmax of the raw target logits at each output token, without a ``[positions, V]`` copy."""
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)
    target_index = (layout.target_starts[:, None] + positions).clamp(max=max(target_logits.shape[0] - 1, 0))
    is_output = token_ids >= 0
    log_normalizers = target_logits.logsumexp(dim=-1)
    logprobs = target_logits[target_index, token_ids.clamp(min=0)] - log_normalizers[target_index]
    return torch.where(is_output, logprobs, float("nan"))
