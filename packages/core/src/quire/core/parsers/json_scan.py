"""Incremental JSON scanning for tool calls: where a value ends, and a call object read a character at a time.

Nothing here parses numbers or builds objects: the scanners track strings, escapes and brackets, which is
enough to stream a value's raw characters as they arrive and to stop exactly at its last character.
"""

from __future__ import annotations

import json

JSON_WHITESPACE = " \t\n\r"
ARGUMENTS_KEYS = ("arguments", "parameters")
_CLOSERS = {"{": "}", "[": "]"}


class MalformedJson(ValueError):
    """The text cannot continue the JSON value or call object being read."""


def _decode_string(raw: str) -> str:
    try:
        return json.loads(raw)
    except ValueError as error:
        raise MalformedJson(f"invalid string {raw!r}") from error


def _is_scalar_char(char: str) -> bool:
    # Numbers, true, false and null; the scanner checks their shape no further.
    return char.isalnum() or char in "+-."


class JsonValueScanner:
    """Finds the end of one JSON value fed a character at a time (the first character starts the value).

    ``feed`` says whether a character belongs to the value. Strings, objects and arrays end on their
    closing character; a bare number or literal (``true``, ``12``) ends only when a character that
    cannot continue it arrives, which then does not belong. Brackets must match; nothing else is validated.
    """

    def __init__(self):
        self._closers: list[str] = []
        self._is_in_string = False
        self._is_escaped = False
        self._is_in_scalar = False
        self.is_done = False

    def feed(self, char: str) -> bool:
        if self.is_done:
            return False
        if self._is_in_string:
            if self._is_escaped:
                self._is_escaped = False
            elif char == "\\":
                self._is_escaped = True
            elif char == '"':
                self._is_in_string = False
                self.is_done = not self._closers
            return True
        if self._is_in_scalar:
            if _is_scalar_char(char):
                return True
            self._is_in_scalar = False
            if not self._closers:
                self.is_done = True
                return False
        return self._feed_structure(char)

    def _feed_structure(self, char: str) -> bool:
        is_top_level = not self._closers
        if char == '"':
            self._is_in_string = True
        elif char in _CLOSERS:
            self._closers.append(_CLOSERS[char])
        elif char in "}]":
            if is_top_level or self._closers.pop() != char:
                raise MalformedJson(f"unexpected {char!r}")
            self.is_done = not self._closers
        elif _is_scalar_char(char):
            self._is_in_scalar = True
        elif is_top_level or char not in JSON_WHITESPACE + ",:":
            raise MalformedJson(f"unexpected {char!r}")
        return True


class CallObjectReader:
    """Reads one ``{"name": ..., "arguments": {...}}`` object, a character at a time.

    ``feed`` returns the raw characters of the arguments value it releases: as they arrive once the name
    is known, or all at once when the name completes if the arguments came first. ``"parameters"`` is an
    alias of ``"arguments"``; other keys are skipped; a repeated key keeps its first value. An object with
    no arguments releases ``{}`` when it closes. Leading whitespace is allowed. Raises MalformedJson on text
    that cannot continue the object, or on a closing brace before any name.
    """

    def __init__(self):
        self.name: str | None = None
        self.is_done = False
        self._state = self._expect_open
        self._scanner: JsonValueScanner | None = None
        self._value_chars: list[str] = []  # a key, or the name value, being read
        self._key = ""
        self._held_arguments: list[str] = []  # arguments read before the name
        self._has_arguments = False

    def feed(self, char: str) -> str:
        if self.is_done:
            raise MalformedJson("the call object is already closed")
        return self._state(char)

    def _expect_open(self, char: str) -> str:
        if char == "{":
            self._state = self._expect_key
        elif char not in JSON_WHITESPACE:
            raise MalformedJson(f"a call object starts with '{{', not {char!r}")
        return ""

    def _expect_key(self, char: str) -> str:
        if char == '"':
            self._start_value(char)
            self._state = self._read_key
            return ""
        if char == "}":
            return self._close()
        if char not in JSON_WHITESPACE:
            raise MalformedJson(f"expected a key, not {char!r}")
        return ""

    def _read_key(self, char: str) -> str:
        self._scanner.feed(char)
        self._value_chars.append(char)
        if self._scanner.is_done:
            self._key = _decode_string("".join(self._value_chars))
            self._state = self._expect_colon
        return ""

    def _expect_colon(self, char: str) -> str:
        if char == ":":
            self._state = self._expect_value
        elif char not in JSON_WHITESPACE:
            raise MalformedJson(f"expected ':', not {char!r}")
        return ""

    def _expect_value(self, char: str) -> str:
        if char in JSON_WHITESPACE:
            return ""
        if self._key == "name" and self.name is None:
            if char != '"':
                raise MalformedJson("the name must be a string")
            self._state = self._read_name
        elif self._key in ARGUMENTS_KEYS and not self._has_arguments:
            self._has_arguments = True
            self._state = self._read_arguments
        else:
            self._state = self._skip_value
        self._start_value("")
        return self._state(char)

    def _start_value(self, first_char: str) -> None:
        self._scanner = JsonValueScanner()
        self._value_chars = []
        if first_char:
            self._scanner.feed(first_char)
            self._value_chars.append(first_char)

    def _read_name(self, char: str) -> str:
        self._scanner.feed(char)
        self._value_chars.append(char)
        if not self._scanner.is_done:
            return ""
        self.name = _decode_string("".join(self._value_chars))
        self._state = self._after_value
        held, self._held_arguments = "".join(self._held_arguments), []
        return held

    def _read_arguments(self, char: str) -> str:
        if not self._scanner.feed(char):  # a bare number or literal ended before this character
            self._state = self._after_value
            return self._after_value(char)
        if self._scanner.is_done:
            self._state = self._after_value
        if self.name is None:
            self._held_arguments.append(char)
            return ""
        return char

    def _skip_value(self, char: str) -> str:
        if not self._scanner.feed(char):
            self._state = self._after_value
            return self._after_value(char)
        if self._scanner.is_done:
            self._state = self._after_value
        return ""

    def _after_value(self, char: str) -> str:
        if char == ",":
            self._state = self._expect_key
        elif char == "}":
            return self._close()
        elif char not in JSON_WHITESPACE:
            raise MalformedJson(f"expected ',' or '}}', not {char!r}")
        return ""

    def _close(self) -> str:
        if self.name is None:
            raise MalformedJson("a call object closed without a name")
        self.is_done = True
        return "" if self._has_arguments else "{}"
