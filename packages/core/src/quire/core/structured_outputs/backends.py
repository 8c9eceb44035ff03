"""The interface every grammar library sits behind, and the registry of the libraries (by name).

A backend compiles a constraint (kind + text) into a compiled grammar that many requests share; each request
gets its own ``Grammar`` (matcher state) from it. A grammar accepts tokens, rolls back, fills its row of
the ``[rows, ceil(vocab / 32)]`` int32 bitmask (bit ``t % 32`` of word ``t // 32`` set = token ``t``
allowed) and says when it has terminated. ``validate`` is the front end's check: it raises
``ValidationError`` for a constraint the backend cannot honour exactly, and needs no tokenizer.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from quire.core.lazy_registry import LazyRegistry

if TYPE_CHECKING:
    import numpy as np

# Longest whitespace run allowed between JSON tokens (unless a request asks for none at all): enough for
# indented output several levels deep, not enough for a model to fill its budget with blanks.
MAX_JSON_WHITESPACE = 12


class Grammar(abc.ABC):
    """One request's position in its compiled grammar."""

    @abc.abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over these tokens; False (and the grammar unusable) if one is not allowed."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def count_valid(self, token_ids: Sequence[int]) -> int:
        """How many of these tokens, from the first, the grammar would accept next; the grammar is left as
        it was (speculative proposals are checked this way)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words, C-contiguous)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has accepted its end (a stop token, or the last character where none is needed)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the start, as if no token had been accepted."""


class CompiledGrammar(abc.ABC):
    """A constraint compiled for one tokenizer; shared (read-only) by every request that uses it."""

    @abc.abstractmethod
    def new_grammar(self) -> Grammar: ...


class StructuredOutputBackend(abc.ABC):
    """A grammar library. ``compile`` may run on any thread (the engine compiles off its busy loop)."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size

    @classmethod
    @abc.abstractmethod
    def validate(cls, kind: str, spec: str, compact: bool) -> None:
        """Raise ``ValidationError`` (naming ``structured_outputs.<kind>``) unless the constraint can be
        enforced exactly: unsupported schema keywords and formats, bad regexes or grammars are refused."""

    @abc.abstractmethod
    def compile(self, kind: str, spec: str, compact: bool) -> CompiledGrammar:
        """Compile a validated constraint (``kind`` one of ``CONSTRAINT_KINDS``; ``spec`` as
        ``StructuredOutputsParams.spec`` gives it); ``compact``: JSON without optional whitespace."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (each a JSON-escaped string literal)."""
    import json

    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


BACKENDS: LazyRegistry[StructuredOutputBackend] = LazyRegistry("structured-output backend", StructuredOutputBackend)
BACKENDS.register("xgrammar", "quire.core.structured_outputs.xgrammar_backend", "XGrammarBackend")
BACKENDS.register("guidance", "quire.core.structured_outputs.guidance_backend", "GuidanceBackend")


def get_backend_class(name: str) -> type[StructuredOutputBackend]:
    return BACKENDS.get(name)
