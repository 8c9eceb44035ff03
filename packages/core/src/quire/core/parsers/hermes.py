"""The hermes tool-call format (Qwen and many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text before, between and after the tags is content. Whitespace inside the tags belongs to the call. A tag
whose inside is not a call object goes out as content, and scanning for the next tag resumes after it.
"""

from __future__ import annotations

from quire.core.parsers.json_scan import JSON_WHITESPACE
from quire.core.parsers.streaming import StepOutput, StreamingToolParser

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(StreamingToolParser):
    """States: outside the tags (holding a possible ``<tool_call>`` prefix), reading the call object, then
    expecting ``</tool_call>``. A call object that breaks after its name went out ends the call there; the
    text from the offending character on is read again as text outside the tags."""

    name = "hermes"

    def __init__(self):
        super().__init__(start=self._outside)

    def _outside(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        after_tag = self._find_marker(text, position, out, OPEN_TAG)
        if after_tag is None:
            return "", 0
        self._begin_call(self._read_call)
        return after_tag, 0

    def _read_call(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        position, is_malformed = self._feed_call(text, position, out)
        if is_malformed:
            if self._call.is_announced:
                again = text[position:]
            else:  # the tag and what followed it are not a call: the tag is content, the rest is read again
                out.add_content(OPEN_TAG)
                again = self._pending[len(OPEN_TAG):] + text[position:]
            return self._read_again(again)
        if self._call.is_done:
            self._state = self._expect_close
        return text, position

    def _expect_close(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        while position < len(text):
            char = text[position]
            tag_part = self._pending.lstrip(JSON_WHITESPACE) + char
            if tag_part == char and char in JSON_WHITESPACE:
                self._pending += char
            elif tag_part == CLOSE_TAG:
                self._pending = ""
                self._state = self._outside
                return text, position + 1
            elif CLOSE_TAG.startswith(tag_part):
                self._pending += char
            else:  # no closing tag: what followed the call is read again as text outside the tags
                return self._read_again(self._pending + text[position:])
            position += 1
        return text, position

    def _read_again(self, text: str) -> tuple[str, int]:
        self._pending = ""
        self._state = self._outside
        return text, 0
