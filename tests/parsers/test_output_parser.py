"""``OutputParser``: reasoning first, then the calls of the answer, the same whole and streamed in any
chunking, for tool_choice auto (hermes), named and required (the constrained JSON shapes)."""

from __future__ import annotations

import json
import random

import pytest

from quire.core.parsers.hermes import HermesToolParser
from quire.core.parsers.output import OutputParser, ParsedOutput
from quire.core.parsers.reasoning import Qwen3ReasoningParser

CASES = [
    # (make the parser, output text, expected content, reasoning, [(name, arguments)])
    (lambda: OutputParser(required=True),
     '[{"name":"add","parameters":{"a":1,"b":-2}},{"name":"lookup","parameters":{"name":"os.pa\\"th ü"}}]',
     None, None, [("add", {"a": 1, "b": -2}), ("lookup", {"name": 'os.pa"th ü'})]),
    (lambda: OutputParser(required=True), '[{"name":"f","parameters":{}}]', None, None, [("f", {})]),
    (lambda: OutputParser(named_tool="add"), '{"a":3,"b":4}', None, None, [("add", {"a": 3, "b": 4})]),
    (lambda: OutputParser(Qwen3ReasoningParser(), named_tool="add"), '<think>sum</think>{"a":3,"b":4}',
     None, "sum", [("add", {"a": 3, "b": 4})]),
    (lambda: OutputParser(Qwen3ReasoningParser(), HermesToolParser()),
     '<think>a <tool_call> inside thinking is not a call</think>Sure.\n<tool_call>\n{"name": "lookup", '
     '"arguments": {"name": "json"}}\n</tool_call>', "Sure.\n", "a <tool_call> inside thinking is not a call",
     [("lookup", {"name": "json"})]),
    (lambda: OutputParser(Qwen3ReasoningParser()), "No thinking here.", "No thinking here.", None, []),
]


def streamed(parser: OutputParser, text: str, rng: random.Random) -> ParsedOutput:
    content, reasoning, calls, position = "", "", {}, 0
    pieces = []
    while position < len(text):
        size = rng.randint(1, 7)
        pieces.append(parser.feed(text[position:position + size]))
        position += size
    pieces.append(parser.finish())
    for piece in pieces:
        content += piece.content
        reasoning += piece.reasoning
        for call in piece.tool_calls:
            if call.id is not None:
                assert call.index not in calls and call.name
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return content, reasoning, [(name, json.loads(arguments)) for name, arguments in calls.values()]


@pytest.mark.parametrize("make,text,content,reasoning,calls", CASES)
def test_whole_and_streamed_agree(make, text, content, reasoning, calls):
    whole = make().parse(text)
    assert whole.content == content and whole.reasoning == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    for seed in range(5):
        got_content, got_reasoning, got_calls = streamed(make(), text, random.Random(seed))
        assert got_content == (content or "") and got_reasoning == (reasoning or "") and got_calls == calls


def test_required_output_cut_short_keeps_the_calls_it_named():
    parsed = OutputParser(required=True).parse('[{"name":"add","parameters":{"a":1')
    assert [c.name for c in parsed.tool_calls] == ["add"] and parsed.tool_calls[0].arguments == '{"a":1'
