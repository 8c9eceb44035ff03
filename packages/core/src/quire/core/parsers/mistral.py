"""The Mistral tool-call formats: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``
objects (older models), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (newer ones).

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so detokenization must keep them. Text before the
marker and after the array (or after a call's arguments) is content; whitespace inside the array belongs
to the calls.
"""

from __future__ import annotations

from quire.core.parsers.json_scan import JSON_WHITESPACE, JsonValueScanner, MalformedJson
from quire.core.parsers.streaming import StepOutput, StreamingToolParser

TOOL_CALLS_MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"


def _is_name_char(char: str) -> bool:
    return char.isalnum() or char in "_-."


class MistralToolParser(StreamingToolParser):
    """States: outside (holding a possible marker prefix), after the marker, then either the array (item,
    call object, after the item) or the name form (name with ``[ARGS]``, arguments value). Malformed text
    is handled as in hermes: before a call's name went out, the marker is content and what followed it is
    read again as outside text; after, the call ends and the text from the offending character is read again.
    """

    name = "mistral"
    needs_special_tokens = True

    def __init__(self):
        super().__init__(start=self._outside)
        self._call_name = ""  # name form: the name read so far
        self._num_args_matched = 0  # name form: how much of [ARGS] follows the name so far
        self._arguments: JsonValueScanner | None = None  # name form: the arguments value once it starts

    def _outside(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        after_marker = self._find_marker(text, position, out, TOOL_CALLS_MARKER)
        if after_marker is None:
            return "", 0
        self._state = self._after_marker
        return after_marker, 0

    def _abandon(self, text: str, position: int, out: StepOutput, is_announced: bool) -> tuple[str, int]:
        again = self._pending + text[position:]
        if not is_announced and again.startswith(TOOL_CALLS_MARKER):
            out.add_content(TOOL_CALLS_MARKER)
            again = again[len(TOOL_CALLS_MARKER):]
        self._pending = ""
        self._state = self._outside
        return again, 0

    def _skip_whitespace_then(self, text: str, position: int) -> int:
        """The position of the next non-whitespace character (whitespace is held)."""
        while position < len(text) and text[position] in JSON_WHITESPACE:
            self._pending += text[position]
            position += 1
        return position

    def _after_marker(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position = self._skip_whitespace_then(text, position)
        if position == len(text):
            return text, position
        char = text[position]
        if char == "[":
            self._pending += char
            self._state = self._array_item
            return text, position + 1
        if _is_name_char(char):
            self._call_name = ""
            self._num_args_matched = 0
            self._state = self._read_name
            return text, position
        return self._abandon(text, position, out, is_announced=False)

    def _array_item(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position = self._skip_whitespace_then(text, position)
        if position == len(text):
            return text, position
        if text[position] != "{":
            return self._abandon(text, position, out, is_announced=False)
        self._begin_call(self._read_call)
        return text, position

    def _read_call(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position, is_malformed = self._feed_call(text, position, out)
        if is_malformed:
            return self._abandon(text, position, out, self._call.is_announced)
        if self._call.is_done:
            self._state = self._after_item
        return text, position

    def _after_item(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position = self._skip_whitespace_then(text, position)
        if position == len(text):
            return text, position
        char = text[position]
        if char == ",":
            self._pending += char
            self._state = self._array_item
        elif char == "]":
            self._pending = ""
            self._state = self._outside
        else:
            return self._abandon(text, position, out, is_announced=True)
        return text, position + 1

    def _read_name(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        while position < len(text):
            char = text[position]
            if self._num_args_matched == 0 and _is_name_char(char):
                self._call_name += char
            elif self._call_name and char == ARGS_MARKER[self._num_args_matched]:
                self._num_args_matched += 1
            else:
                return self._abandon(text, position, out, is_announced=False)
            self._pending += char
            position += 1
            if self._num_args_matched == len(ARGS_MARKER):
                out.start_call(self._num_calls, self._call_name)
                self._pending = ""
                self._arguments = None
                self._state = self._read_arguments
                break
        return text, position

    def _read_arguments(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        index = self._num_calls
        while position < len(text):
            char = text[position]
            if self._arguments is None:
                if char in JSON_WHITESPACE:  # whitespace before the value belongs to the call
                    position += 1
                    continue
                self._arguments = JsonValueScanner()
            try:
                belongs = self._arguments.feed(char)
            except MalformedJson:
                belongs = False
            if not belongs:
                self._num_calls += 1
                return self._abandon(text, position, out, is_announced=True)
            out.add_arguments(index, char)
            position += 1
            if self._arguments.is_done:
                self._num_calls += 1
                self._state = self._outside
                break
        return text, position
