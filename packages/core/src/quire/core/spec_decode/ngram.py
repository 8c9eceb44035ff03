"""The n-gram (prompt-lookup) proposer: draft tokens copied from earlier in the request's own sequence.

Torch-free (numpy only): the scheduler calls it once per step for every running request.
"""

from __future__ import annotations

import numpy as np

from quire.core.errors import ConfigError


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` tokens by looking the sequence's tail up in the sequence.

    For token ids ``t[0..L-1]`` (prompt + output so far) it looks for the longest ``n``, from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``, such that the last ``n`` tokens ``t[L-n..L-1]``
    also occur earlier, ending at some position ``j <= L - 2``. "Earlier" means the occurrence is followed
    by at least one token, so the suffix itself (ending at ``L - 1``) never counts; occurrences may overlap
    the suffix (in ``a a a`` the suffix ``a a`` occurs ending at 1). The proposal is what followed:
    ``t[j+1 : j+1+k]``, fewer than ``k`` tokens when the sequence ends sooner. No match gives no proposal.

    Among several occurrences of the longest tail, the most recent one (largest ``j``) wins: what the
    model wrote last is the best guess of what it is copying now (an edited line, the latest turn of a
    chat, the current iteration of a repeated pattern), while an early one reflects stale context. The
    price: its continuation is cut by the end of the sequence, so in a strictly periodic tail the
    proposal can be shorter than ``k`` even though an older occurrence had more tokens after it.

    The search is vectorised over positions: one comparison over the whole sequence finds the candidate
    ends ``j`` whose token equals the last token (matches of length 1), then each of at most
    ``prompt_lookup_max - 1`` rounds keeps the candidates whose match also holds one token further back,
    with numpy indexing. Python loops only over those rounds and over the rows of a batch, never over
    positions; after the first pass the work shrinks with the number of candidates left.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ConfigError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({prompt_lookup_min}) must not exceed prompt_lookup_max "
                              f"({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose_requests(self, requests) -> list[list[int]]:
        """The proposals of each request (a ``quire.core.request.Request``), from its tokens so far."""
        return [self.propose(np.asarray(request.all_token_ids)).tolist() for request in requests]

    def remove_requests(self, request_ids) -> None:
        """Nothing is kept per request."""

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """0 to ``num_speculative_tokens`` draft tokens (int64, a new array) for a 1-D sequence of ids."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
        num_tokens = len(tokens)
        # An occurrence of n tokens ending at j <= L - 2 needs L - 1 >= n.
        max_ngram = min(self.prompt_lookup_max, num_tokens - 1)
        if max_ngram < self.prompt_lookup_min:
            return _empty()
        # Candidates: end positions j whose token equals the last one (a match of length 1). Each round
        # keeps those whose match also holds one token further back; they stay sorted, so the last
        # survivor of the last round that had any is the most recent occurrence of the longest match.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(ends) == 0:
            return _empty()
        end, best_length = ends[-1], 1
        for length in range(2, max_ngram + 1):
            ends = ends[ends >= length - 1]  # the occurrence must start at or after position 0
            ends = ends[tokens[ends - (length - 1)] == tokens[num_tokens - length]]
            if len(ends) == 0:
                break
            end, best_length = ends[-1], length
        if best_length < self.prompt_lookup_min:
            return _empty()
        return tokens[end + 1:end + 1 + self.num_speculative_tokens].astype(np.int64)

    def propose_batch(self, sequences: list[np.ndarray], skip: list[bool] | None = None) -> list[np.ndarray]:
        """One proposal per sequence; rows with ``skip[i]`` set (not speculating this step) get none."""
        if skip is not None and len(skip) != len(sequences):
            raise ValueError(f"skip has {len(skip)} entries for {len(sequences)} sequences")
        return [_empty() if skip is not None and skip[row] else self.propose(sequence)
                for row, sequence in enumerate(sequences)]


def _empty() -> np.ndarray:
    return np.empty(0, dtype=np.int64)
