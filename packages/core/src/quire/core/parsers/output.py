"""One completion's text as a chat message: the reasoning split off first (a reasoning parser), then the
tool calls found in the answer: by a tool parser (``tool_choice`` auto, unconstrained), or read from the
constrained output of a named or ``required`` tool choice (``tool_choice.ToolRequest.constraint``).

``parse(text)`` takes a whole output; ``feed(delta)`` / ``finish()`` take it streamed, in any chunking, and
add up to the same thing. A named call's arguments stream as the model writes them (its first delta carries
the id and the name); so do the calls of a ``required`` choice, read from the constraint's JSON array of
``{"name", "parameters"}`` objects by ``RequiredCallsParser``. Tool calls are looked for in the answer,
never in the reasoning.
"""

from __future__ import annotations

import dataclasses

from quire.core.parsers.json_scan import JSON_WHITESPACE
from quire.core.parsers.reasoning import ReasoningParser
from quire.core.parsers.streaming import StepOutput, StreamingToolParser
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
        if required:
            tool_parser = RequiredCallsParser()
        self.tool_parser = SafeToolParser(tool_parser) if tool_parser is not None else None
        self.named_tool = named_tool
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
        return ParsedDelta(content=text)


class RequiredCallsParser(StreamingToolParser):
    """The output of a ``required`` tool choice: a JSON array of ``{"name": ..., "parameters": {...}}``
    objects (the constraint guarantees the shape). Each call streams as it is written (name first, then
    its parameters as the arguments); the array's brackets, commas and whitespace belong to no field.
    Anything else (only possible without the constraint) is content."""

    name = "required"

    def __init__(self):
        super().__init__(start=self._before_array)

    def _before_array(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        while position < len(text) and text[position] in JSON_WHITESPACE:
            position += 1
        if position == len(text):
            return text, position
        if text[position] != "[":
            return self._to_content(text[position:])
        self._state = self._between_calls
        return text, position + 1

    def _between_calls(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        while position < len(text):
            char = text[position]
            if char == "{":
                self._begin_call(self._read_call)
                return text, position
            if char == "]":
                self._state = self._after_array
                return text, position + 1
            if char not in JSON_WHITESPACE and char != ",":
                return self._to_content(text[position:])
            position += 1
        return text, position

    def _read_call(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position, is_malformed = self._feed_call(text, position, out)
        if is_malformed:
            return self._to_content(self._pending + text[position:])
        if self._call.is_done:
            self._state = self._between_calls
        return text, position

    def _after_array(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        rest = text[position:]
        if rest.strip(JSON_WHITESPACE):
            return self._to_content(rest)
        return "", 0
