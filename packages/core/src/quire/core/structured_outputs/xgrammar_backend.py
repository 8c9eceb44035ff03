"""The xgrammar backend (the default): JSON schemas in strict mode (no properties or items beyond those a
schema names, as OpenAI's strict mode), regexes, EBNF or Lark grammars, choices and structural tags."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from quire.core.errors import ValidationError
from quire.core.structured_outputs.backends import (
    MAX_JSON_WHITESPACE,
    CompiledGrammar,
    Grammar,
    StructuredOutputBackend,
    choice_ebnf,
)
from quire.core.structured_outputs.guidance_backend import unimplemented_schema_features

_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class XGrammarGrammar(Grammar):
    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return all(self.matcher.accept_token(token_id) for token_id in token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.compiled = compiled

    def new_grammar(self) -> Grammar:
        return XGrammarGrammar(xgr.GrammarMatcher(self.compiled))


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids))
        # NOTE: Quire keeps its own cache of compiled grammars (keyed by constraint), so xgrammar's is off.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @classmethod
    def validate(cls, kind: str, spec: str, compact: bool) -> None:
        param = f"structured_outputs.{kind}"
        if kind == "json":
            problems = unimplemented_schema_features(spec)
            if problems:
                raise ValidationError(f"{param}: the JSON schema uses what cannot be enforced: {problems}",
                                      param=param)
        try:
            cls._grammar(kind, spec, compact)
        except Exception as error:  # noqa: BLE001 - xgrammar's errors have no common base
            raise ValidationError(f"{param} is not supported by the xgrammar backend: {_message(error)}",
                                  param=param) from None

    @staticmethod
    def _grammar(kind: str, spec: str, compact: bool) -> xgr.Grammar:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, **_json_options(compact))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_OBJECT_SCHEMA, strict_mode=False, **_whitespace(compact))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
        if kind == "grammar":
            try:
                return xgr.Grammar.from_ebnf(spec)
            except RuntimeError as ebnf_error:
                try:
                    return xgr.Grammar.from_lark(spec)
                except (RuntimeError, ValueError):
                    raise ebnf_error from None
        if kind == "structural_tag":
            return _structural_tag(spec, xgr.Grammar.from_structural_tag)
        raise ValueError(f"unknown constraint kind {kind!r}")

    def compile(self, kind: str, spec: str, compact: bool) -> CompiledGrammar:
        compiler = self.compiler
        if kind == "json":
            compiled = compiler.compile_json_schema(spec, **_json_options(compact))
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(_OBJECT_SCHEMA, strict_mode=False, **_whitespace(compact))
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        elif kind == "structural_tag":
            compiled = _structural_tag(spec, compiler.compile_structural_tag)
        else:
            compiled = compiler.compile_grammar(self._grammar(kind, spec, compact))
        return XGrammarCompiled(compiled)


def _whitespace(compact: bool) -> dict:
    if compact:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _json_options(compact: bool) -> dict:
    return {"strict_mode": True, **_whitespace(compact)}


def _structural_tag(spec: str, build):
    """vLLM's form ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``, or xgrammar's own
    ``{"type": "structural_tag", "format": ...}`` passed through."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return build(items, list(tag.get("triggers", [])))
    return build(spec)


def _message(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[-1] if lines else type(error).__name__)
