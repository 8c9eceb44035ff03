"""One completion's text as a chat message: the reasoning split off first (a reasoning parser), then the
tool calls found in the answer: by a tool parser (``tool_choice`` auto, unconstrained), or read from the
constrained output of a named or ``required`` tool choice (``tool_choice.ToolRequest.constraint``).

``parse(text)`` takes a whole output; ``feed(delta)`` / ``finish()`` take it streamed, in any chunking, and
add up to the same thing. A named call's arguments stream as the model writes them (its first delta carries
the id and the name); the calls of a ``required`` choice go out whole once the output is complete (the
constraint's JSON array is parsed at the end). Tool calls are looked for in the answer, never in the
reasoning.
"""

from __future__ import annotations

import dataclasses
import json

from quire.core.parsers.reasoning import ReasoningParser
from quire.core.parsers.tool_calls import SafeToolParser, ToolCall, ToolCallDelta, ToolParser, new_call_id


@dataclasses.dataclass
class ParsedOutput:
    content: str | None  # None when the answer is only tool calls (or empty and there are calls)
    reasoning: str | None  # None without a reasoning parser or without thinking
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputParser:
    """Per completion (one instance each; streaming state). ``tool_parser`` for ``auto``, ``named_tool`` for
    a named choice, ``required`` for ``required``; at most one of the three."""

    def __init__(self, reasoning_parser: ReasoningParser | None = None, tool_parser: ToolParser | None = None,
                 named_tool: str | None = None, required: bool = False):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = SafeToolParser(tool_parser) if tool_parser is not None else None
        self.named_tool = named_tool
        self.required = required
        self._answer: list[str] = []  # the answer text so far (named, required)
        self._call_id: str | None = None

    # -- whole outputs ----------------------------------------------------------------------------

    def parse(self, text: str) -> ParsedOutput:
        reasoning, answer = (None, text) if self.reasoning_parser is None else self.reasoning_parser.extract(text)
        if self.tool_parser is not None:
            extracted = self.tool_parser.extract(answer)
            content = extracted.content if extracted.content or not extracted.tool_calls else None
            return ParsedOutput(content, reasoning, extracted.tool_calls)
        if self.named_tool is not None:
            return ParsedOutput(None, reasoning, [ToolCall(self.named_tool, answer, new_call_id())])
        if self.required:
            calls = _required_calls(answer)
            return ParsedOutput(None if calls else answer, reasoning, calls or [])
        return ParsedOutput(answer, reasoning)

    # -- streamed outputs ---------------------------------------------------------------------------

    def feed(self, delta_text: str) -> ParsedDelta:
        if self.reasoning_parser is None:
            return self._answer_delta(delta_text)
        split = self.reasoning_parser.extract_delta(delta_text)
        delta = self._answer_delta(split.content)
        delta.reasoning = split.reasoning
        return delta

    def finish(self) -> ParsedDelta:
        reasoning = ""
        tail = ""
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.finish()
            reasoning, tail = split.reasoning, split.content
        delta = self._answer_delta(tail) if tail else ParsedDelta()
        delta.reasoning += reasoning
        if self.tool_parser is not None:
            last = self.tool_parser.finish()
            delta.content += last.content
            delta.tool_calls += last.tool_calls
        elif self.required:
            answer = "".join(self._answer)
            calls = _required_calls(answer)
            if calls is None:
                delta.content += answer
            else:
                delta.tool_calls += [ToolCallDelta(i, call.id, call.name, call.arguments)
                                     for i, call in enumerate(calls)]
        return delta

    def _answer_delta(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self.tool_parser is not None:
            found = self.tool_parser.extract_delta(text)
            return ParsedDelta(content=found.content, tool_calls=found.tool_calls)
        if self.named_tool is not None:
            if self._call_id is None:
                self._call_id = new_call_id()
                return ParsedDelta(tool_calls=[ToolCallDelta(0, self._call_id, self.named_tool, text)])
            return ParsedDelta(tool_calls=[ToolCallDelta(0, arguments=text)])
        if self.required:
            self._answer.append(text)
            return ParsedDelta()
        return ParsedDelta(content=text)


def _required_calls(answer: str) -> list[ToolCall] | None:
    """The calls of a ``required`` choice's output (a JSON array of ``{"name", "parameters"}``); None when
    the output is not one (cut short by ``max_tokens``)."""
    try:
        items = json.loads(answer)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
        return None
    return [ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False), new_call_id())
            for item in items]
