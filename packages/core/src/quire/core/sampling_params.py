"""Per-request sampling and stopping parameters (a msgspec struct, so it travels to the engine as is)."""

from __future__ import annotations

import enum
import json
import math
from typing import Any, NoReturn

import msgspec

from quire.core.errors import ValidationError

# Temperatures below this are treated as greedy decoding.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
# the constraints of StructuredOutputsParams, in the order their kinds are named in messages
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One constraint on a request's output, enforced by masking the logits at every step (as vLLM's
    ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value it validates;
    - ``regex``: the whole output matches this regular expression;
    - ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar (EBNF/GBNF for xgrammar; Lark or GBNF for guidance);
    - ``json_object``: any JSON object;
    - ``structural_tag``: xgrammar's structural tag (a dict or its JSON text): free text in which
      tagged regions follow their schemas.

    ``backend`` picks the grammar library for this request (``auto``, ``xgrammar``, ``guidance``; None: the
    engine's ``structured_outputs_backend``). ``disable_any_whitespace`` makes JSON compact (no optional
    whitespace at all); otherwise a whitespace run in JSON is at most ``MAX_JSON_WHITESPACE`` characters.
    The front end resolves ``backend`` and checks the constraint before the request is admitted.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    backend: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _json_text(value, name))
        if self.json_object is False:
            self.json_object = None
        given = self.constraint_kinds()
        _check(len(given) == 1, "structured_outputs",
               "structured_outputs must set exactly one of " + ", ".join(CONSTRAINT_KINDS)
               + (f"; got {', '.join(given)}" if given else "; got none"))
        _check(self.backend is None or self.backend in STRUCTURED_OUTPUT_BACKENDS, "structured_outputs.backend",
               f"structured_outputs.backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}; "
               f"got {self.backend!r}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != ""), f"structured_outputs.{name}",
                   f"structured_outputs.{name} must be a non-empty string" +
                   (" or a JSON object" if name in ("json", "structural_tag") else ""))
        if self.choice is not None:
            _check(isinstance(self.choice, list) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice), "structured_outputs.choice",
                   "structured_outputs.choice must be a non-empty list of non-empty strings")

    def constraint_kinds(self) -> list[str]:
        """The constraints this object sets (a valid one sets exactly one)."""
        return [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None]

    @property
    def kind(self) -> str:
        return self.constraint_kinds()[0]

    @property
    def spec(self) -> str:
        """The constraint as text: the schema, regex, grammar or structural tag; the choices as a JSON list;
        an empty string for ``json_object``."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return json.dumps(value, ensure_ascii=False)
        return "" if value is True else value


def _json_text(value: dict, name: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValidationError(f"structured_outputs.{name} is not JSON: {error}",
                              param=f"structured_outputs.{name}") from None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. Invalid values raise ``ValidationError`` naming the field.

    Semantics follow vLLM:

    - ``n`` completions per prompt; with a ``seed``, completion ``i`` is seeded ``seed + i``.
    - penalties: ``repetition_penalty`` (> 0, 1 = off) scales the logits of every token seen in the
      prompt or the output (divides positive logits, multiplies negative ones); ``frequency_penalty``
      subtracts ``penalty * count`` and ``presence_penalty`` subtracts ``penalty`` for tokens already
      generated (both in [-2, 2]).
    - ``top_k`` of 0 or -1 disables top-k; ``max_tokens=None`` means "until the context is full".
    - ``stop`` strings are matched on the detokenized text in the front end, ``stop_token_ids`` in the
      engine; ``min_tokens`` suppresses EOS, stop token ids and stop strings until that many tokens exist.
    - ``bad_words`` are never generated (each word, with and without a leading space, as a token sequence).
    - ``logit_bias`` adds a bias in [-100, 100] to token ids; ``allowed_token_ids`` restricts sampling.
    - ``logprobs=k`` returns, per generated token, the top-k logprobs plus the sampled token's logprob and
      rank; ``prompt_logprobs=k`` does the same for each prompt token after the first. Logprobs are taken
      from the model's raw distribution, before any penalty, bias or temperature.
    - ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar (see
      ``StructuredOutputsParams``); logprobs stay those of the model, before the constraint's mask.
    - ``truncate_prompt_tokens=k`` keeps only the last k prompt tokens (-1: as many as the model allows).
    - ``stream_interval=k`` (streaming outputs): after the first token, an output is handed over once at
      least k new tokens have accumulated, and at the end; raised to the engine's ``stream_interval``.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    bad_words: list[str] = []
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    stream_interval: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed == -1:
            self.seed = None
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def _validate(self) -> None:
        # Each message is formatted only when its check fails: a request passes ~20 checks on its way in.
        if not (_is_int(self.n) and self.n >= 1):
            _fail("n", f"n must be at least 1, got {self.n}")
        if not (_is_number(self.temperature) and self.temperature >= 0):
            _fail("temperature", f"temperature must be a number >= 0, got {self.temperature}")
        if self.is_greedy and self.n > 1:
            _fail("n", f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2 <= value <= 2):
                _fail(name, f"{name} must be in [-2, 2], got {value}")
        if not (_is_number(self.repetition_penalty) and 0 < self.repetition_penalty):
            _fail("repetition_penalty", f"repetition_penalty must be a number > 0, got {self.repetition_penalty}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            _fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            _fail("top_k", f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            _fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.seed is None or _is_int(self.seed)):
            _fail("seed", f"seed must be an integer, got {self.seed!r}")
        if not (self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1)):
            _fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            _fail("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.max_tokens is None or self.min_tokens <= self.max_tokens):
            _fail("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop and not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "stop must be a non-empty string or a list of non-empty strings")
        if self.bad_words and not all(isinstance(s, str) and s for s in self.bad_words):
            _fail("bad_words", "bad_words must be a list of non-empty strings")
        if self.stop_token_ids and not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if not (value is None or (_is_int(value) and value >= -1)):
                _fail(name, f"{name} must be a non-negative integer, or -1 for the whole vocabulary; got {value}")
        if self.logit_bias is not None and not all(
                t >= 0 and _is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                for t, b in self.logit_bias.items()):
            _fail("logit_bias",
                  f"logit_bias must map token ids >= 0 to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None and not (
                len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            _fail("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        if not (self.truncate_prompt_tokens is None
                or (_is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1
                                                              or self.truncate_prompt_tokens == -1))):
            _fail("truncate_prompt_tokens",
                  f"truncate_prompt_tokens must be at least 1, or -1; got {self.truncate_prompt_tokens}")
        if not (self.stream_interval is None or (_is_int(self.stream_interval) and self.stream_interval >= 1)):
            _fail("stream_interval", f"stream_interval must be at least 1, got {self.stream_interval}")


def _int_keys(bias: dict) -> dict[int, float]:
    try:
        return {int(token): bias_value for token, bias_value in bias.items()}
    except (TypeError, ValueError):
        raise ValidationError("logit_bias keys must be token ids", param="logit_bias") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        _fail(param, message)


def _fail(param: str, message: str) -> NoReturn:
    raise ValidationError(message, param=param)
