"""Reasoning parsers: split a model's thinking from its answer, whole or streamed, chosen by name.

Text in, text out (no torch): the front end runs one parser per request over the detokenized output.

What every parser here keeps and drops:

- The tags themselves appear in neither field. Nothing else is stripped: the newlines a model writes
  after ``</think>`` stay at the head of the content, byte for byte, both in ``extract`` and streamed.
- Whitespace before an opening ``<think>`` is dropped with the tag (it is formatting, not thinking).
- Only the first ``</think>`` ends the thinking; a later one is answer text. A ``<think>`` that does not
  open the output is ordinary text.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import ClassVar

from quire.core.lazy_registry import LazyRegistry


@dataclasses.dataclass
class ReasoningDelta:
    """What one streamed chunk added: new thinking text and new answer text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser(abc.ABC):
    """Splits one request's output into reasoning and content; one instance per request.

    Contract:

    - ``extract(text)`` parses a whole output: ``(reasoning, content)``, reasoning None when the output
      had no thinking at all ("" when it had an empty one).
    - ``extract_delta`` takes the output in chunks of any size and returns what each chunk added; it holds
      back text that may still turn out to be part of a tag. ``finish`` returns what was held back. The
      concatenated deltas equal ``extract`` of the concatenated text.
    - ``is_reasoning_end(text)``: whether a (whole, possibly unfinished) output has ended its thinking, so
      the answer has begun and a structured-output constraint may start. It only turns from False to
      True as the text grows.
    - ``end_tag``: the text that ends thinking; the front end tokenizes it for the engine.
    """

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, str]: ...

    @abc.abstractmethod
    def extract_delta(self, delta_text: str) -> ReasoningDelta: ...

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta: ...

    @abc.abstractmethod
    def is_reasoning_end(self, text: str) -> bool: ...


class _Phase(enum.Enum):
    OPENING = enum.auto()  # not yet known whether the output opens with a start tag
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ThinkTagReasoningParser(ReasoningParser):
    """Thinking between ``start_tag`` and ``end_tag`` at the head of the output.

    ``is_thinking_implicit``: the chat template already opened the thinking, so an output without a start
    tag begins as reasoning (DeepSeek-R1); otherwise such an output has no thinking and is all content.
    Either way an output with thinking but no end tag (cut by length) is all reasoning.
    """

    is_thinking_implicit: ClassVar[bool]

    def __init__(self) -> None:
        self._phase = _Phase.OPENING
        self._pending = ""  # received, not yet returned: an unresolved opening or a partial end tag

    def extract(self, text: str) -> tuple[str | None, str]:
        thinking_start = self._thinking_start(text)
        if thinking_start is None:
            return None, text
        reasoning, _, content = text[thinking_start:].partition(self.end_tag)
        return reasoning, content

    def extract_delta(self, delta_text: str) -> ReasoningDelta:
        self._pending += delta_text
        delta = ReasoningDelta()
        if self._phase is _Phase.OPENING:
            self._resolve_opening()
        if self._phase is _Phase.REASONING:
            end = self._pending.find(self.end_tag)
            if end == -1:
                # NOTE: only a suffix that may begin the end tag is held; an end tag can never start
                # inside text already returned.
                end = len(self._pending) - _partial_tag_length(self._pending, self.end_tag)
                delta.reasoning, self._pending = self._pending[:end], self._pending[end:]
            else:
                delta.reasoning, self._pending = self._pending[:end], self._pending[end + len(self.end_tag):]
                self._phase = _Phase.CONTENT
        if self._phase is _Phase.CONTENT:
            delta.content, self._pending = self._pending, ""
        return delta

    def finish(self) -> ReasoningDelta:
        if self._phase is _Phase.OPENING:  # the output ended before a start tag was complete
            self._phase = self._phase_without_start_tag()
        held, self._pending = self._pending, ""
        return ReasoningDelta(reasoning=held) if self._phase is _Phase.REASONING else ReasoningDelta(content=held)

    def is_reasoning_end(self, text: str) -> bool:
        if self.is_thinking_implicit or _after_start_tag(text, self.start_tag) is not None:
            return self.end_tag in text
        # No start tag yet: the answer has begun once the text can no longer become one.
        return not self.start_tag.startswith(text.lstrip())

    def _thinking_start(self, text: str) -> int | None:
        """Where the thinking begins in a whole output; None when it has none."""
        after = _after_start_tag(text, self.start_tag)
        if after is not None:
            return after
        return 0 if self.is_thinking_implicit else None

    def _resolve_opening(self) -> None:
        after = _after_start_tag(self._pending, self.start_tag)
        if after is not None:
            self._pending = self._pending[after:]
            self._phase = _Phase.REASONING
        elif not self.start_tag.startswith(self._pending.lstrip()):
            self._phase = self._phase_without_start_tag()

    def _phase_without_start_tag(self) -> _Phase:
        return _Phase.REASONING if self.is_thinking_implicit else _Phase.CONTENT


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3: ``<think>...</think>`` opens the output when the model thinks; without it all is content.

    ``is_reasoning_end`` is also True once the output has visibly not opened with ``<think>``: there is
    no thinking to wait for. While the output is only whitespace or a prefix of ``<think>`` it is False.
    """

    name = "qwen3"
    is_thinking_implicit = False


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1: the chat template opened ``<think>``, so the output is reasoning up to ``</think>``.

    A ``<think>`` the model repeats at the head of its output is dropped. With no end tag the whole output
    is reasoning and the content is empty. Reasoning is never None here (the thinking was always opened).
    """

    name = "deepseek_r1"
    is_thinking_implicit = True


def _after_start_tag(text: str, start_tag: str) -> int | None:
    """The index just past ``start_tag`` when it opens ``text`` after optional whitespace, else None."""
    stripped = text.lstrip()
    if not stripped.startswith(start_tag):
        return None
    return len(text) - len(stripped) + len(start_tag)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


REASONING_PARSERS: LazyRegistry[ReasoningParser] = LazyRegistry("reasoning parser", ReasoningParser)
REASONING_PARSERS.register("deepseek_r1", "quire.core.parsers.reasoning", "DeepSeekR1ReasoningParser")
REASONING_PARSERS.register("qwen3", "quire.core.parsers.reasoning", "Qwen3ReasoningParser")


def get_reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name`` (``--reasoning-parser``); ConfigError naming it if unknown."""
    return REASONING_PARSERS.get(name)
