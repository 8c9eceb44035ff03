"""Collecting a request's logprobs in the front end, as ``{token_id: Logprob}`` per position."""

from __future__ import annotations

from quire.core.outputs import Logprob, PositionLogprobs
from quire.core.wire import Logprobs


class LogprobsAccumulator:
    """Sampled-token logprobs (kept in step with the kept token ids) and prompt logprobs."""

    def __init__(self, tokenizer, num_logprobs: int | None, num_prompt_logprobs: int | None):
        self._tokenizer = tokenizer
        self.sampled: list[PositionLogprobs] | None = [] if num_logprobs is not None else None
        self.prompt: list[PositionLogprobs | None] | None = (
            [None] if num_prompt_logprobs is not None else None)
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None

    @property
    def num_sampled(self) -> int:
        return len(self.sampled) if self.sampled is not None else 0

    def add_sampled(self, logprobs: Logprobs | None, num_kept: int) -> None:
        """Add the logprobs of new tokens, of which only the first ``num_kept`` were kept (a stop
        string may have dropped the rest)."""
        if self.sampled is None or logprobs is None:
            return
        positions = self._positions(logprobs)[:num_kept]
        self.sampled += positions
        self.cumulative_logprob += float(logprobs.logprobs[:num_kept, 0].sum())

    def add_prompt(self, logprobs: Logprobs) -> None:
        if self.prompt is not None:
            self.prompt += self._positions(logprobs)

    def sampled_since(self, start: int, end: int) -> list[PositionLogprobs] | None:
        return None if self.sampled is None else self.sampled[start:end]

    def _positions(self, logprobs: Logprobs) -> list[PositionLogprobs]:
        all_ids, all_values = logprobs.token_ids.tolist(), logprobs.logprobs.tolist()
        ids = sorted({token for row in all_ids for token in row})
        texts = dict(zip(ids, self._tokenizer.backend_tokenizer.decode_batch(
            [[token] for token in ids], skip_special_tokens=False)))
        positions = []
        for token_ids, values, rank in zip(all_ids, all_values, logprobs.ranks.tolist()):
            position = {}
            for i, (token, value) in enumerate(zip(token_ids, values)):
                if token not in position:
                    # the chosen token (first) carries its rank; top-k entries are ranked by place
                    position[token] = Logprob(value, rank if i == 0 else i, texts[token])
            positions.append(position)
        return positions
