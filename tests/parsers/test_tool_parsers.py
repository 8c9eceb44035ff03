"""Tool-call parsers over seeded outputs rendered from known (content, calls): whole, token by token through
the demo tokenizer's detokenizer, and in random character chunks; plus malformed and truncated outputs."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import subprocess
import sys

import pytest

from quire.core.errors import ConfigError
from quire.core.parsers.json_scan import JsonValueScanner, MalformedJson
from quire.core.parsers.tool_calls import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    SafeToolParser,
    ToolCallsDelta,
    ToolParser,
    get_tool_parser_class,
)

PARSER_NAMES = ["hermes", "llama3_json", "mistral", "pythonic"]
NUM_CASES_PER_PARSER = 60
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
MARKERS = ["<tool_call>", "[TOOL_CALLS]"]

# Strings inside arguments: unicode, escapes, brackets and every format's markers.
STRINGS = ["Paris", "naïve café", "日本語", "😀 ok", "e\u0301", 'say "hi"', "back\\slash", "line\nbreak", "\ttab",
           "}", "]", "{[", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "'", ";,:",
           "\u2028", "\x07", ""]
KEYS = ["city", "unit", "query", "count", "données", "x_1", "options"]
NAMES = ["get_weather", "search", "f", "send_email", "tool_2"]
# Content: unicode, newlines and pieces of markers that must be held back and then released unchanged.
CONTENT_WORDS = ["Sure", " thing", ".", " 😀", " 中文", " é", "\n", "\n\n", " ", "<", "<tool", "<tool_call",
                 "</tool_call>", "[TOOL", "[TOOL_CALLS", "[ARGS]", "{", "}", "[", "]", "(", ")", "'", '"', " x=1", "\t",
                 "<|python"]
WHITESPACE = ["", "", " ", "\n", "\n  ", "\t", "  \n"]


@dataclasses.dataclass(frozen=True)
class Case:
    text: str
    content: str
    calls: tuple[tuple[str, object, str | None], ...]  # (name, arguments value, exact arguments text or None)
    after: str  # the content after the last call


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["str", "str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 2 else []))
    if kind == "str":
        return rng.choice(STRINGS) + rng.choice(STRINGS)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -1.25e-7, 3.0, 1e21])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_arguments(rng, depth + 1)


def random_arguments(rng: random.Random, depth: int = 0) -> dict:
    if rng.random() < 0.2:
        return {}
    return {rng.choice(KEYS): random_value(rng, depth) for _ in range(rng.randint(1, 4))}


def render_json(rng: random.Random, value: object) -> str:
    indent = rng.choice([None, None, None, 2])
    separators = None if indent else rng.choice([None, (",", ":"), (", ", ": ")])
    return json.dumps(value, ensure_ascii=rng.random() < 0.3, indent=indent, separators=separators)


def random_content(rng: random.Random, max_words: int = 6) -> str:
    while True:
        text = "".join(rng.choice(CONTENT_WORDS) for _ in range(rng.randint(0, max_words)))
        if not any(marker in text for marker in MARKERS):
            return text


def json_call(rng: random.Random, name: str, arguments: dict) -> tuple[str, str]:
    """A call object (random key order, whitespace, alias and extra key) and the exact arguments text."""
    ws = lambda: rng.choice(WHITESPACE)  # noqa: E731
    arguments_text = render_json(rng, arguments)
    members = [f'"name"{ws()}:{ws()}{json.dumps(name)}']
    if arguments or rng.random() < 0.7:
        members.append(f'"{rng.choice(["arguments", "arguments", "parameters"])}":{ws()}{arguments_text}')
    else:
        arguments_text = "{}"  # the object has no arguments at all
    if rng.random() < 0.2:
        members.append(f'"type": {json.dumps(rng.choice(STRINGS))}')
    if rng.random() < 0.2:
        rng.shuffle(members)
    return "{" + ws() + f",{ws()}".join(members) + ws() + "}", arguments_text


def random_calls(rng: random.Random, index: int) -> list[tuple[str, dict]]:
    num_calls = [0, 1, 1, 2, 3][index % 5]
    return [(rng.choice(NAMES), random_arguments(rng)) for _ in range(num_calls)]


def hermes_case(rng: random.Random, index: int) -> Case:
    text, content, calls = "", "", []
    for name, arguments in random_calls(rng, index):
        before = random_content(rng)
        body, arguments_text = json_call(rng, name, arguments)
        text += before + "<tool_call>" + rng.choice(WHITESPACE) + body + rng.choice(WHITESPACE) + "</tool_call>"
        content += before
        calls.append((name, arguments, arguments_text))
    after = random_content(rng)
    return Case(text + after, content + after, tuple(calls), after)


def llama3_json_case(rng: random.Random, index: int) -> Case:
    calls = random_calls(rng, index)
    if not calls:
        text = rng.choice(WHITESPACE) + rng.choice(["Hello", "<b>hi</b>", "<|python_tag|>print(1)", "It is {"])
        text += random_content(rng)
        return Case(text, text, (), text)
    objects, expected = [], []
    for name, arguments in calls:
        body, arguments_text = json_call(rng, name, arguments)
        objects.append(body)
        expected.append((name, arguments, arguments_text))
    separator = rng.choice(WHITESPACE) + rng.choice([";", ";", ""]) + rng.choice(WHITESPACE)
    if not separator:
        separator = "; "
    prefix = rng.choice(WHITESPACE) + rng.choice(["", "<|python_tag|>"]) + rng.choice(WHITESPACE)
    after = rng.choice(["", "", rng.choice(WHITESPACE) + "Done" + random_content(rng)])
    return Case(prefix + separator.join(objects) + after, after, tuple(expected), after)


def mistral_case(rng: random.Random, index: int) -> Case:
    calls = random_calls(rng, index)
    before, after = random_content(rng), random_content(rng)
    if not calls:
        return Case(before, before, (), before)
    expected = []
    if rng.random() < 0.5:  # the array form
        objects = []
        for name, arguments in calls:
            body, arguments_text = json_call(rng, name, arguments)
            objects.append(body)
            expected.append((name, arguments, arguments_text))
        ws = lambda: rng.choice(WHITESPACE)  # noqa: E731
        array = "[" + ws() + f"{ws()},{ws()}".join(objects) + ws() + "]"
        return Case(before + "[TOOL_CALLS]" + ws() + array + after, before + after, tuple(expected), after)
    text, content = "", ""
    for name, arguments in calls:  # the name form, with content between the calls
        arguments_text = render_json(rng, arguments)
        between = random_content(rng) if text else before
        text += between + "[TOOL_CALLS]" + name + "[ARGS]" + arguments_text
        content += between
        expected.append((name, arguments, arguments_text))
    return Case(text + after, content + after, tuple(expected), after)


def python_call(rng: random.Random, name: str, arguments: dict) -> str:
    keywords = [f"{key}{rng.choice(['=', ' = '])}{value!r}" for key, value in arguments.items()]
    return name + "(" + f",{rng.choice([' ', '', chr(10)])}".join(keywords) + ")"


def pythonic_case(rng: random.Random, index: int) -> Case:
    calls = random_calls(rng, index)
    if not calls:
        text = rng.choice(WHITESPACE) + rng.choice(["Hello", "[1, 2] are numbers", "[f(x)] is code", "[]"])
        text += random_content(rng)
        return Case(text, text, (), text)
    python_calls = [python_call(rng, name, arguments) for name, arguments in calls]
    listing = "[" + rng.choice(["", " ", "\n"]) + rng.choice([", ", ",", ",\n "]).join(python_calls) + "]"
    after = rng.choice(["", random_content(rng)])
    expected = tuple((name, arguments, None) for name, arguments in calls)
    return Case(rng.choice(WHITESPACE) + listing + after, after, expected, after)


CASE_BUILDERS = {"hermes": hermes_case, "llama3_json": llama3_json_case, "mistral": mistral_case,
                 "pythonic": pythonic_case}


def generate(name: str) -> list[Case]:
    rng = random.Random(f"tool-parsers-{name}")
    return [CASE_BUILDERS[name](rng, index) for index in range(NUM_CASES_PER_PARSER)]


CASES = {name: generate(name) for name in PARSER_NAMES}


def merge_stream(deltas: list[ToolCallsDelta]) -> ExtractedToolCalls:
    """The streamed result, checking the delta contract: ids and names once, first, indexes in order."""
    merged = ExtractedToolCalls(content="", tool_calls=[])
    for delta in deltas:
        merged.content += delta.content
        indexes = [piece.index for piece in delta.tool_calls]
        assert len(set(indexes)) == len(indexes)
        for piece in delta.tool_calls:
            if piece.index == len(merged.tool_calls):
                assert CALL_ID.fullmatch(piece.id) and piece.name
                merged.tool_calls.append(dataclasses.replace(piece))
            else:
                assert piece.index < len(merged.tool_calls) and piece.id is None and piece.name is None
                merged.tool_calls[piece.index].arguments += piece.arguments
    return merged


def without_ids(result: ExtractedToolCalls) -> tuple[str, list[tuple[str, str]]]:
    return result.content, [(call.name, call.arguments) for call in result.tool_calls]


def stream(name: str, chunks: list[str]) -> ExtractedToolCalls:
    parser = get_tool_parser_class(name)()
    return merge_stream([parser.extract_delta(chunk) for chunk in chunks] + [parser.finish()])


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, start = [], 0
    while start < len(text):
        size = rng.randint(1, 12)
        chunks.append(text[start:start + size])
        start += size
    return chunks


def check_expected(case: Case, result: ExtractedToolCalls) -> None:
    assert result.content == case.content
    assert [call.name for call in result.tool_calls] == [name for name, _, _ in case.calls]
    for call, (_, arguments, arguments_text) in zip(result.tool_calls, case.calls):
        assert json.loads(call.arguments) == arguments
        assert call.arguments == (arguments_text or json.dumps(arguments, ensure_ascii=False))
    ids = [call.id for call in result.tool_calls]
    assert all(CALL_ID.fullmatch(call_id) for call_id in ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_whole_and_chunked_outputs_give_the_known_calls(name):
    rng = random.Random(name)
    for case in CASES[name]:
        extracted = get_tool_parser_class(name)().extract(case.text)
        check_expected(case, extracted)
        for chunks in (list(case.text), random_chunks(case.text, rng), random_chunks(case.text, rng)):
            assert without_ids(stream(name, chunks)) == without_ids(extracted), (case.text, chunks)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from quire.core.demo import demo_model_path
    from quire.core.tokenizer import load_tokenizer

    return load_tokenizer(str(demo_model_path()))


def detokenized_pieces(tokenizer, text: str) -> list[str]:
    """The delta texts the front end's detokenizer produces for ``text`` generated one token at a time."""
    from quire.core.engine.detokenizer import IncrementalDetokenizer
    from quire.core.sampling_params import SamplingParams

    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(max_tokens=None))
    pieces = []
    for token_id in token_ids:
        detokenizer.update([token_id], stop_terminated=False)
        pieces.append(detokenizer.next_text(finished=False, delta=True))
    detokenizer.finish(stop_terminated=False)
    pieces.append(detokenizer.next_text(finished=True, delta=True))
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_token_by_token_through_the_detokenizer(demo_tokenizer, name):
    for case in CASES[name]:
        streamed = stream(name, detokenized_pieces(demo_tokenizer, case.text))
        check_expected(case, streamed)
        assert without_ids(streamed) == without_ids(get_tool_parser_class(name)().extract(case.text))


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_the_generated_outputs_cover_every_kind(name):
    cases = CASES[name]
    assert len(cases) >= 50
    num_calls = [len(case.calls) for case in cases]
    assert {0, 1, 2, 3} <= set(num_calls)
    arguments = [arguments for case in cases for _, arguments, _ in case.calls]
    assert {} in arguments
    texts = "".join(case.text for case in cases)
    escapes = ["\\'", "\\\\", "\\n"] if name == "pythonic" else ['\\"', "\\\\", "\\n", "\\u"]
    assert all(piece in texts for piece in ["é", "😀", *escapes])
    assert any(len(case.calls) > 1 and case.after.strip() for case in cases)
    if name in ("hermes", "mistral"):  # text before the calls too
        marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}[name]
        assert any(case.calls and case.text[:case.text.find(marker)].strip() for case in cases)


PRIMERS = {
    "hermes": 'Hi <tool_call>{"name": "f", "arguments": {"a": [1, "x}"]}}</tool_call> bye',
    "llama3_json": '<|python_tag|>{"name": "f", "parameters": {"a": [1, "x}"]}}; {"name": "g", "parameters": {}}',
    "mistral": 'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": [1, "x}"]}}] bye',
    "pythonic": '[f(a=[1, "x]"]), g()] bye',
}


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_truncated_outputs_stream_as_they_extract(name):
    """Cut anywhere (max_tokens): streaming and extract agree, calls are prefixes of the whole ones, and the
    content is text of the output in order."""
    text = PRIMERS[name]
    whole = get_tool_parser_class(name)().extract(text)
    for end in range(len(text) + 1):
        prefix = text[:end]
        extracted = get_tool_parser_class(name)().extract(prefix)
        assert without_ids(stream(name, list(prefix))) == without_ids(extracted), prefix
        for call, whole_call in zip(extracted.tool_calls, whole.tool_calls):
            assert call.name == whole_call.name and whole_call.arguments.startswith(call.arguments)
        remaining = iter(prefix)
        assert all(char in remaining for char in extracted.content), prefix  # a subsequence of the output


MALFORMED = [
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", '<tool_call>{"name": 1}</tool_call>', '<tool_call>{"name": 1}</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>x', '<tool_call>{"arguments": {}}</tool_call>x', []),
    ("hermes", '<tool_call>{"name": "f", "arg', "", [("f", "")]),
    ("hermes", '<tool_call>{"name"', '<tool_call>{"name"', []),
    ("hermes", '<tool_call>{"name": "f"} oops</tool_call>', " oops</tool_call>", [("f", "{}")]),
    ("hermes", '<tool_call><tool_call>{"name": "f"}</tool_call>', "<tool_call>", [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>', "]}</tool_call>", [("f", '{"a": 1')]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and more', " and more", [("f", '{"a": 1}')]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}\n', "\n", [("f", '{"a": 1}')]),
    ("llama3_json", '{"nam": "f"} text', '{"nam": "f"} text', []),
    ("llama3_json", '{"name": "f"}; ;{"name": "g"}', '; ;{"name": "g"}', [("f", "{}")]),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("mistral", '[TOOL_CALLS] nope', "[TOOL_CALLS] nope", []),
    ("mistral", '[TOOL_CALLS][{"name": "f"}, oops', ", oops", [("f", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "f"}, {"x": 1}]', ', {"x": 1}]', [("f", "{}")]),
    ("mistral", '[TOOL_CALLS]f[ARGS]7 later', " later", [("f", "7")]),
    ("mistral", '[TOOL_CALLS]f g[ARGS]{}', "[TOOL_CALLS]f g[ARGS]{}", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("pythonic", "[f(a=x)]", "[f(a=x)]", []),
    ("pythonic", "[f(a={1, 2})]", "[f(a={1, 2})]", []),
    ("pythonic", "[f(**kw)]", "[f(**kw)]", []),
    ("pythonic", "[f(a=1), 2]", "[f(a=1), 2]", []),
    ("pythonic", '[f(a="unclosed)]', '[f(a="unclosed)]', []),
    ("pythonic", "[f(a=(1, 2), b=None, c=True)]", "", [("f", '{"a": [1, 2], "b": null, "c": true}')]),
]


@pytest.mark.parametrize("name,text,content,calls", MALFORMED)
def test_malformed_calls_become_content_and_no_text_is_lost(name, text, content, calls):
    extracted = get_tool_parser_class(name)().extract(text)
    assert without_ids(extracted) == (content, calls)
    assert without_ids(stream(name, list(text))) == (content, calls)


def test_hermes_streams_the_name_first_and_holds_back_no_argument_text():
    parser = get_tool_parser_class("hermes")()
    assert parser.extract_delta("Hi <tool_") == ToolCallsDelta(content="Hi ")
    assert parser.held_text() == "<tool_"
    delta = parser.extract_delta('call>\n{"name": "get_weather"')
    assert delta.content == "" and [(piece.name, piece.arguments) for piece in delta.tool_calls] == [
        ("get_weather", "")]
    delta = parser.extract_delta(', "arguments": {"city": "Pa')
    assert [(piece.index, piece.name, piece.arguments) for piece in delta.tool_calls] == [(0, None, '{"city": "Pa')]
    delta = parser.extract_delta('ris"}}\n</tool_call>!')
    assert delta.content == "!" and delta.tool_calls[0].arguments == 'ris"}'
    assert parser.finish() == ToolCallsDelta()


def test_arguments_before_the_name_go_out_with_it():
    parser = get_tool_parser_class("hermes")()
    assert parser.extract_delta('<tool_call>{"arguments": {"a": 1}, ') == ToolCallsDelta()
    delta = parser.extract_delta('"name": "f"}</tool_call>')
    assert [(piece.name, piece.arguments) for piece in delta.tool_calls] == [("f", '{"a": 1}')]


def test_json_value_scanner_stops_at_the_end_of_the_value():
    def end_of(text):
        scanner = JsonValueScanner()
        for position, char in enumerate(text):
            if not scanner.feed(char):
                return position
            if scanner.is_done:
                return position + 1
        return None

    assert end_of('{"a": "}\\"]", "b": [1, {}]}, next') == len('{"a": "}\\"]", "b": [1, {}]}')
    assert end_of('"x\\\\"y') == 5
    assert end_of("-1.5e3}") == 6
    with pytest.raises(MalformedJson):
        end_of('{"a": [1}')
    with pytest.raises(MalformedJson):
        end_of("}")


class FailingParser(ToolParser):
    """A hermes parser that fails on its ``fail_at``-th streaming call, after changing its state."""

    name = "failing"

    def __init__(self, fail_at: int = 10**9):
        self.parser = get_tool_parser_class("hermes")()
        self.num_calls = 0
        self.fail_at = fail_at

    def extract_delta(self, delta_text: str) -> ToolCallsDelta:
        self.num_calls += 1
        delta = self.parser.extract_delta(delta_text)
        if self.num_calls == self.fail_at:
            raise RuntimeError("injected")
        return delta

    def finish(self) -> ToolCallsDelta:
        if self.num_calls + 1 == self.fail_at:
            raise RuntimeError("injected")
        return self.parser.finish()

    def held_text(self) -> str:
        return self.parser.held_text()


def test_safe_parser_degrades_to_content_mid_stream(caplog):
    chunks = ['Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> <tool_', 'call>{"name": "g"',
              ', "arguments": {}}</tool_call>', " bye"]
    with caplog.at_level(logging.WARNING):
        safe = SafeToolParser(FailingParser(fail_at=2))
        merged = merge_stream([safe.extract_delta(chunk) for chunk in chunks] + [safe.finish()])
    assert without_ids(merged) == (
        "Hi  " + '<tool_call>{"name": "g", "arguments": {}}</tool_call> bye', [("f", '{"a": 1}')])
    assert safe.is_degraded and len([r for r in caplog.records if "tool parser" in r.getMessage()]) == 1


def test_safe_parser_degrades_in_finish_and_in_extract():
    safe = SafeToolParser(FailingParser(fail_at=2))
    assert safe.extract_delta("text <tool_call>{") == ToolCallsDelta(content="text ")
    assert safe.finish() == ToolCallsDelta(content="<tool_call>{")

    class Broken(FailingParser):
        def extract(self, text):
            raise RuntimeError("injected")

    assert SafeToolParser(Broken()).extract("a <tool_call>") == ExtractedToolCalls(content="a <tool_call>",
                                                                                   tool_calls=[])
    whole = SafeToolParser(FailingParser()).extract('<tool_call>{"name": "f"}</tool_call>')
    assert without_ids(whole) == ("", [("f", "{}")])


def test_registry_names_the_parsers_and_the_special_token_need():
    assert TOOL_PARSERS.names() == sorted(PARSER_NAMES)
    for name in PARSER_NAMES:
        parser_class = get_tool_parser_class(name)
        assert parser_class.name == name
        assert parser_class.needs_special_tokens == (name == "mistral")
    with pytest.raises(ConfigError, match="unknown tool parser 'nope'"):
        get_tool_parser_class("nope")


def test_parsers_import_no_heavy_module():
    code = ("import sys; from quire.core.parsers.tool_calls import get_tool_parser_class; "
            f"[get_tool_parser_class(name) for name in {PARSER_NAMES!r}]; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
