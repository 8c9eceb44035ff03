"""The pythonic tool-call format (Llama 3.2 and 4): the output is a Python list of calls,
``[get_weather(city="Paris"), get_time()]``, after optional whitespace.

Each call takes keyword arguments whose values are Python literals (``ast.literal_eval``); its arguments
become ``json.dumps`` of them. Anything else (positional arguments, names, expressions, a list that is not
all calls, an empty list) makes the list content. Text after the list is content.

Streaming: a list may only turn out not to be calls at its last call, and a call that went out cannot be
taken back, so the list is held until its closing bracket and all its calls go out together, each with its
arguments in one fragment.
"""

from __future__ import annotations

import ast
import json

from quire.core.parsers.streaming import StepOutput, StreamingToolParser


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def _call_from(node: ast.expr) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call with literal keyword arguments only, else None."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted_name(node.func)
    if name is None or any(keyword.arg is None for keyword in node.keywords):  # None: **mapping
        return None
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (bytes, sets)
        return None


def parse_call_list(source: str) -> list[tuple[str, str]] | None:
    """The calls of ``source`` if it is exactly a non-empty list of calls; None if it is not Python or not
    such a list (a ``SyntaxError`` is the caller's sign that the list is not complete yet)."""
    tree = ast.parse(source, mode="eval")
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call_from(element) for element in tree.body.elts]
    return None if None in calls else calls


class PythonicToolParser(StreamingToolParser):
    """States: the start (holding whitespace), the list (held until it parses), then content to the end."""

    name = "pythonic"

    def __init__(self):
        super().__init__(start=self._start)
        self._list_start = 0  # where "[" is in _pending
        self._num_scanned = 0  # how much of _pending was searched for "]"

    def _start(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        buffer = self._pending + text[position:]
        body = buffer.lstrip()
        if not body:
            self._pending = buffer
            return "", 0
        if body[0] != "[":
            return self._to_content(buffer)
        self._list_start = len(buffer) - len(body)
        self._pending, self._num_scanned = "", self._list_start
        self._state = self._read_list
        return buffer, 0

    def _read_list(self, text: str, position: int, out: StepOutput) -> tuple[str, int]:
        self._pending += text[position:]
        # The list ends at the first "]" where the text so far parses: a "]" inside a string or before the
        # last bracket leaves the text unfinished, a syntax error.
        end = self._pending.find("]", self._num_scanned)
        while end != -1:
            try:
                calls = parse_call_list(self._pending[self._list_start:end + 1])
            except (SyntaxError, ValueError):
                end = self._pending.find("]", end + 1)
                continue
            if calls is None:
                return self._to_content(self._pending)
            for index, (name, arguments) in enumerate(calls):
                out.start_call(index, name)
                out.add_arguments(index, arguments)
            return self._to_content(self._pending[end + 1:])
        self._num_scanned = len(self._pending)
        return "", 0
