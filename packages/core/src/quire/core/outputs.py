"""What front ends hand to users: ``RequestOutput`` with one ``CompletionOutput`` per sequence."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence. ``stop_reason`` is the stop string or stop token id that ended it,
    or None (EOS, length, abort)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's prompt and its output(s) so far (or the new part, in delta mode)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
