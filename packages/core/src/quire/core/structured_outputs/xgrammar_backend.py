"""The xgrammar backend (the default): JSON schemas in strict mode (no properties or items beyond those a
schema names, as OpenAI's strict mode), regexes, EBNF or Lark grammars, choices and structural tags.

NOTE: xgrammar 0.2.9 turns a string with ``minLength``/``maxLength`` (and no ``pattern``) into a rule that
admits raw control characters, which no JSON parser accepts; such strings are given the equivalent
``pattern`` (xgrammar's JSON-string regexes exclude control characters), see ``_fix_string_lengths``.
"""

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

    def count_valid(self, token_ids: Sequence[int]) -> int:
        count = 0
        for token_id in token_ids:  # a refused token leaves the matcher as it was
            if not self.matcher.accept_token(token_id):
                break
            count += 1
        if count:
            self.matcher.rollback(count)
        return count

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
            return xgr.Grammar.from_json_schema(_fix_string_lengths(spec), **_json_options(compact))
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
            compiled = compiler.compile_json_schema(_fix_string_lengths(spec), **_json_options(compact))
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(_OBJECT_SCHEMA, strict_mode=False, **_whitespace(compact))
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        elif kind == "structural_tag":
            compiled = _structural_tag(spec, compiler.compile_structural_tag)
        else:
            compiled = compiler.compile_grammar(self._grammar(kind, spec, compact))
        return XGrammarCompiled(compiled)


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not subschemas


def _fix_string_lengths(spec: str) -> str:
    """Give every string subschema with length limits but no ``pattern`` or ``format`` the pattern
    ``^.{min,max}$`` instead (same lengths; as a JSON-string regex it excludes control characters)."""
    schema = json.loads(spec)
    return json.dumps(_rewrite(schema), ensure_ascii=False) if _has_length_strings(schema) else spec


def _is_length_string(node: dict) -> bool:
    return (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
            and "pattern" not in node and "format" not in node)


def _has_length_strings(node: Any) -> bool:
    if isinstance(node, dict):
        return _is_length_string(node) or any(_has_length_strings(value) for key, value in node.items()
                                              if key not in _DATA_KEYWORDS)
    if isinstance(node, list):
        return any(_has_length_strings(item) for item in node)
    return False


def _rewrite(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: value if key in _DATA_KEYWORDS else _rewrite(value) for key, value in node.items()}
    if _is_length_string(node):
        low, high = int(node.pop("minLength", 0)), node.pop("maxLength", None)
        node["pattern"] = f"^.{{{low},{'' if high is None else int(high)}}}$"
    return node


def _whitespace(compact: bool) -> dict:
    if compact:
        return {"any_whitespace": False, "separators": (",", ":")}
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
