"""The llguidance backend: JSON schemas (refusing, rather than ignoring, keywords it cannot enforce),
regexes, Lark or GBNF grammars and choices. llguidance needs no torch, so the front end also uses it to
find the schema keywords that no backend enforces."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from quire.core.errors import ValidationError
from quire.core.structured_outputs.backends import (
    MAX_JSON_WHITESPACE,
    CompiledGrammar,
    Grammar,
    StructuredOutputBackend,
)

# llguidance's verdicts that hold for any backend: a keyword or string format nobody enforces.
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[[^\]]*\]|Unknown format: \S+")
_OBJECT_SCHEMA = '{"type": "object"}'


def unimplemented_schema_features(schema: str) -> str | None:
    """The keywords (``Unimplemented keys: [...]``) or formats (``Unknown format: ...``) of a JSON schema
    that would be ignored rather than enforced; None if there are none."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError:
        return None  # not a JSON object: the backend's own check says so
    found = _UNIMPLEMENTED.search(llguidance.LLMatcher.validate_grammar(grammar))
    return found.group(0) if found else None


class GuidanceGrammar(Grammar):
    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return self.matcher.consume_tokens(list(token_ids)) and not self.matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def count_valid(self, token_ids: Sequence[int]) -> int:
        return self.matcher.validate_tokens(list(token_ids))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()


class GuidanceCompiled(CompiledGrammar):
    def __init__(self, template: llguidance.LLMatcher):
        self.template = template  # never advanced: each request gets a copy

    def new_grammar(self) -> Grammar:
        return GuidanceGrammar(self.template.deep_copy())


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))

    @classmethod
    def validate(cls, kind: str, spec: str, compact: bool) -> None:
        param = f"structured_outputs.{kind}"
        if kind == "structural_tag":
            raise ValidationError(f"{param} is supported by the xgrammar backend only", param=param)
        try:
            grammar = cls._grammar(kind, spec, compact)
        except ValueError as error:
            raise ValidationError(f"{param} is not supported by the guidance backend: {error}", param=param) from None
        message = llguidance.LLMatcher.validate_grammar(grammar)
        if message:
            raise ValidationError(f"{param} is not supported by the guidance backend: {_first_line(message)}",
                                  param=param)

    @staticmethod
    def _grammar(kind: str, spec: str, compact: bool) -> str:
        options = _json_options(compact)
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_OBJECT_SCHEMA, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
        raise ValueError(f"constraint kind {kind!r} is not supported")

    def compile(self, kind: str, spec: str, compact: bool) -> CompiledGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, self._grammar(kind, spec, compact), log_level=0)
        if matcher.is_error():
            raise ValueError(_first_line(matcher.get_error()))
        return GuidanceCompiled(matcher)


def _json_options(compact: bool) -> dict:
    if compact:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True,
            "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "invalid"
