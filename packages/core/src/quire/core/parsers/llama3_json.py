"""The Llama 3.1 JSON tool-call format: the whole output is ``{"name": ..., "parameters": {...}}``, or several
such objects separated by ``;``, after optional whitespace and an optional ``<|python_tag|>``.

An output that starts otherwise is content. The whitespace, tag and separators before and between the calls
belong to them; text after the last call (with the whitespace before it) is content.
"""

from __future__ import annotations

from quire.core.parsers.json_scan import JSON_WHITESPACE
from quire.core.parsers.streaming import StepOutput, StreamingToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(StreamingToolParser):
    """States: the start (holding whitespace and a possible tag), reading a call object, between calls
    (holding whitespace and one ``;``), then content to the end. A call object that breaks turns the rest of
    the output into content: from its start if its name had not gone out, else from the offending character.
    """

    name = "llama3_json"

    def __init__(self):
        super().__init__(start=self._start)
        self._has_separator = False

    def _start(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        buffer = self._pending + text[position:]
        body = buffer.lstrip(JSON_WHITESPACE)
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip(JSON_WHITESPACE)
        elif PYTHON_TAG.startswith(body):  # nothing yet but whitespace and maybe the start of the tag
            body = ""
        if not body:
            self._pending = buffer
            return "", 0
        if body[0] != "{":
            return self._to_content(buffer)
        self._pending = buffer[:len(buffer) - len(body)]
        self._begin_call(self._read_call)
        return buffer, len(buffer) - len(body)

    def _read_call(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position, is_malformed = self._feed_call(text, position, out)
        if is_malformed:
            return self._to_content(self._pending + text[position:])
        if self._call.is_done:
            self._has_separator = False
            self._state = self._between_calls
        return text, position

    def _between_calls(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        while position < len(text):
            char = text[position]
            if char == "{":
                self._begin_call(self._read_call)
                return text, position
            if char in JSON_WHITESPACE or (char == ";" and not self._has_separator):
                self._has_separator |= char == ";"
                self._pending += char
                position += 1
            else:
                return self._to_content(self._pending + text[position:])
        return text, position
