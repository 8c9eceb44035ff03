"""Per-request sampling and stopping parameters (a msgspec struct, so it travels to the engine as is)."""

from __future__ import annotations

import enum

import msgspec

from quire.core.errors import ValidationError

# Temperatures below this are treated as greedy decoding.
GREEDY_TEMPERATURE = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. Invalid values raise ``ValidationError`` naming the field.

    ``top_k`` of 0 or -1 disables top-k; ``max_tokens=None`` means "until the context is full";
    ``stop`` strings are matched on the detokenized text in the front end, ``stop_token_ids`` in the
    engine; ``min_tokens`` suppresses EOS, stop token ids and stop strings until that many tokens exist.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"temperature must be a number >= 0, got {self.temperature}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or isinstance(self.seed, int), "seed",
               f"seed must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop must be a non-empty string or a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be a list of non-negative integers")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise ValidationError(message, param=param)
