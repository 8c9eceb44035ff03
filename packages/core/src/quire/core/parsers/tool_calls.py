"""Tool-call parsers: the result types, the parser contract, the registry by name and a fail-safe wrapper.

Text in, text out (no torch): the front end runs one parser per request over the detokenized output and
turns the calls it finds into OpenAI ``tool_calls``. The formats live in their own modules (``hermes``,
``llama3_json``, ``mistral``, ``pythonic``).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import uuid
from typing import ClassVar

from quire.core.lazy_registry import LazyRegistry

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ToolCall:
    """A complete call. ``arguments`` is the JSON text of the arguments as the model wrote it (JSON formats)
    or ``json.dumps`` of the evaluated keyword arguments (pythonic); ``id`` is ``call_`` + 24 hex digits."""

    name: str
    arguments: str
    id: str


@dataclasses.dataclass
class ToolCallDelta:
    """One streamed piece of a call (OpenAI's ``delta.tool_calls[i]``).

    ``id`` and ``name`` come whole on the call's first delta only; the ``arguments`` fragments of a call
    concatenate to its ``ToolCall.arguments``.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class ExtractedToolCalls:
    """A whole output split: ``content`` is all the text outside the calls, in order."""

    content: str
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class ToolCallsDelta:
    """What one streamed chunk added: content and pieces of calls (at most one piece per call)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(abc.ABC):
    """Finds tool calls in one request's output, whole or streamed; one instance per request.

    Contract:

    - ``extract_delta`` takes the output in chunks of any size. Content goes out as soon as it cannot be the
      start of a call marker; a call's name goes out whole and first, then its arguments as they arrive
      (a format whose calls can only be validated whole, pythonic, sends each call whole).
    - ``finish`` ends the stream and returns what was held back, as content. A call whose name went out
      stays a call even when the output ends inside it (its arguments are then cut short, as OpenAI does
      when ``max_tokens`` ends a call); text of a call that never got that far is content.
    - ``extract(text)`` equals the merged deltas of streaming ``text`` in any chunking (by default it
      streams the text through a fresh instance, so the two cannot disagree).
    - Every character of the output is either content or part of exactly one call's text; text that turns
      out not to be a well-formed call is content.
    - ``held_text()``: the text received and not yet given out as content nor taken into a call; what
      ``SafeToolParser`` sends as content if the parser fails.
    - ``needs_special_tokens``: the markers are special tokens that detokenization must keep.
    """

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False

    def extract(self, text: str) -> ExtractedToolCalls:
        fresh = type(self)()
        return merge_tool_call_deltas([fresh.extract_delta(text), fresh.finish()])

    @abc.abstractmethod
    def extract_delta(self, delta_text: str) -> ToolCallsDelta: ...

    @abc.abstractmethod
    def finish(self) -> ToolCallsDelta: ...

    @abc.abstractmethod
    def held_text(self) -> str: ...


def merge_tool_call_deltas(deltas: list[ToolCallsDelta]) -> ExtractedToolCalls:
    """The whole result that a sequence of streamed deltas adds up to (calls in index order)."""
    content = "".join(delta.content for delta in deltas)
    first_pieces: dict[int, ToolCallDelta] = {}
    fragments: dict[int, list[str]] = {}
    for piece in (piece for delta in deltas for piece in delta.tool_calls):
        first_pieces.setdefault(piece.index, piece)
        fragments.setdefault(piece.index, []).append(piece.arguments)
    calls = [ToolCall(name=first_pieces[index].name, arguments="".join(fragments[index]), id=first_pieces[index].id)
             for index in sorted(first_pieces)]
    return ExtractedToolCalls(content=content, tool_calls=calls)


class SafeToolParser:
    """Wraps a parser so that its failure never breaks a response.

    A parser exception while streaming turns the rest of the request into plain content: the text the
    parser held back and every later chunk go out as content (calls already streamed stay as they were).
    A failing ``extract`` returns the whole text as content with no calls. One warning per request.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.is_degraded = False

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            return self.parser.extract(text)
        except Exception:
            self._warn()
            return ExtractedToolCalls(content=text, tool_calls=[])

    def extract_delta(self, delta_text: str) -> ToolCallsDelta:
        if self.is_degraded:
            return ToolCallsDelta(content=delta_text)
        held = ""
        try:
            held = self.parser.held_text()
            return self.parser.extract_delta(delta_text)
        except Exception:
            self._warn()
            self.is_degraded = True
            return ToolCallsDelta(content=held + delta_text)

    def finish(self) -> ToolCallsDelta:
        if self.is_degraded:
            return ToolCallsDelta()
        held = ""
        try:
            held = self.parser.held_text()
            return self.parser.finish()
        except Exception:
            self._warn()
            self.is_degraded = True
            return ToolCallsDelta(content=held)

    def _warn(self) -> None:
        logger.warning("tool parser %r failed; the rest of this output is plain content",
                       getattr(self.parser, "name", type(self.parser).__name__), exc_info=True)


TOOL_PARSERS: LazyRegistry[ToolParser] = LazyRegistry("tool parser", ToolParser)
TOOL_PARSERS.register("hermes", "quire.core.parsers.hermes", "HermesToolParser")
TOOL_PARSERS.register("llama3_json", "quire.core.parsers.llama3_json", "Llama3JsonToolParser")
TOOL_PARSERS.register("mistral", "quire.core.parsers.mistral", "MistralToolParser")
TOOL_PARSERS.register("pythonic", "quire.core.parsers.pythonic", "PythonicToolParser")


def get_tool_parser_class(name: str) -> type[ToolParser]:
    """The parser class registered as ``name`` (``--tool-call-parser``); ConfigError naming it if unknown."""
    return TOOL_PARSERS.get(name)
