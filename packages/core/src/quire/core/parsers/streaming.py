"""The machinery the tool parsers share: one step's output, marker hold-back, and a state-machine base class."""

from __future__ import annotations

from collections.abc import Callable

from quire.core.parsers.json_scan import CallObjectReader, MalformedJson
from quire.core.parsers.tool_calls import ToolCallDelta, ToolCallsDelta, ToolParser, new_call_id


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (to hold back)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class StepOutput:
    """Collects what one ``extract_delta``/``finish`` call gives out; one delta per call index at most."""

    def __init__(self):
        self._content: list[str] = []
        self._tool_calls: list[ToolCallDelta] = []
        self._arguments: list[list[str]] = []  # fragments per delta, joined at the end (no repeated copies)

    def add_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def start_call(self, index: int, name: str) -> None:
        self._tool_calls.append(ToolCallDelta(index=index, id=new_call_id(), name=name))
        self._arguments.append([])

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if not self._tool_calls or self._tool_calls[-1].index != index:
            self._tool_calls.append(ToolCallDelta(index=index))
            self._arguments.append([])
        self._arguments[-1].append(text)

    def result(self) -> ToolCallsDelta:
        for delta, fragments in zip(self._tool_calls, self._arguments):
            delta.arguments = "".join(fragments)
        return ToolCallsDelta(content="".join(self._content), tool_calls=self._tool_calls)


class JsonCallRead:
    """One call read from a JSON object: announced (id and name) once its name completes, then streamed.

    ``feed`` raises ``MalformedJson`` from the reader; ``is_announced`` tells the parser whether the call's
    text so far has gone out (then it belongs to the call) or must stay held as possible content.
    """

    def __init__(self, index: int):
        self.index = index
        self.reader = CallObjectReader()
        self.is_announced = False

    @property
    def is_done(self) -> bool:
        return self.reader.is_done

    def feed(self, char: str, out: StepOutput) -> None:
        released = self.reader.feed(char)
        if not self.is_announced and self.reader.name is not None:
            out.start_call(self.index, self.reader.name)
            self.is_announced = True
        out.add_arguments(self.index, released)


# A state reads ``text`` from ``position`` and returns the text and position to go on from: the same text
# further on, or new text (what a failed call gives back to be read again, followed by the rest).
State = Callable[[str, int, StepOutput], tuple[str, int]]


class StreamingToolParser(ToolParser):
    """A tool parser written as states (methods of the subclass) over the streamed text.

    ``_pending`` is ``held_text()``: a possible marker, or the text of a call whose name has not gone out.
    ``finish`` gives it out as content. ``_num_calls`` counts the calls announced so far (the next index).
    """

    def __init__(self, start: State):
        self._pending = ""
        self._num_calls = 0
        self._call: JsonCallRead | None = None
        self._state = start

    def held_text(self) -> str:
        return self._pending

    def extract_delta(self, delta_text: str) -> ToolCallsDelta:
        out = StepOutput()
        text, position = delta_text, 0
        while position < len(text):
            text, position = self._state(text, position, out)
        return out.result()

    def finish(self) -> ToolCallsDelta:
        out = StepOutput()
        out.add_content(self._pending)
        self._pending = ""
        return out.result()

    def _find_marker(self, text: str, position: int, out: StepOutput, marker: str) -> str | None:
        """Outside calls: content up to ``marker``, then the text after it (the marker is held); None when
        the text ends first (a possible start of the marker is held)."""
        buffer = self._pending + text[position:]
        start = buffer.find(marker)
        if start == -1:
            num_held = partial_marker_length(buffer, marker)
            out.add_content(buffer[:len(buffer) - num_held])
            self._pending = buffer[len(buffer) - num_held:]
            return None
        out.add_content(buffer[:start])
        self._pending = marker
        return buffer[start + len(marker):]

    def _feed_call(self, text: str, position: int, out: StepOutput) -> tuple[int, bool]:
        """Feeds ``_call`` until it closes or the text ends: ``(position, is_malformed)``; when malformed,
        ``position`` is at the offending character and ``_pending`` holds the call's unannounced text."""
        call = self._call
        while position < len(text):
            char = text[position]
            try:
                call.feed(char, out)
            except MalformedJson:
                self._num_calls += call.is_announced
                return position, True
            position += 1
            self._pending = "" if call.is_announced else self._pending + char
            if call.is_done:
                self._num_calls += 1
                break
        return position, False

    def _begin_call(self, next_state: State) -> None:
        self._call = JsonCallRead(self._num_calls)
        self._state = next_state

    def _to_content(self, text: str) -> tuple[str, int]:
        """Everything from ``text`` on is content, to the end of the output."""
        self._pending = ""
        self._state = self._content
        return text, 0

    def _content(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        out.add_content(text[position:])
        return "", 0
