"""Reasoning parsers over seeded outputs built from known (reasoning, content): whole, token by token
through the demo tokenizer's detokenizer, and in random character chunks."""

from __future__ import annotations

import dataclasses
import random

import pytest

from quire.core.errors import ConfigError
from quire.core.parsers.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser_class,
)

NUM_CASES_PER_PARSER = 60
START, END = "<think>", "</think>"
# Text that looks like a tag (or part of one) without being the end tag, unicode, and newlines.
FRAGMENTS = ["the", " answer", " is", " 42", ".", " x < y", "<", "</thi", "</think", "<thin", "<think>", "think>",
             "/think>", "< /think>", "<b>", "</b>", "Café", " 中文", " 😀", " e\u0301tude", "\n", "\n\n", " ", "  ",
             "\t", "{\"k\": [1, 2]}", "a<", ">"]
LEADING_WHITESPACE = ["", "", "", "\n", "  ", "\n\n"]


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    text: str
    reasoning: str | None
    content: str
    answer_start: int | None  # where is_reasoning_end turns True (the length of the shortest such prefix)


def random_text(rng: random.Random, max_fragments: int = 8) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, max_fragments)))


def thinking_text(rng: random.Random) -> str:
    while END in (text := random_text(rng)):
        pass
    return text


def answer_text(rng: random.Random) -> str:
    # The answer may hold a literal end tag: only the first one ends the thinking.
    return rng.choice(["", "\n\n", "\n"]) + random_text(rng) + rng.choice(["", "", END + random_text(rng, 2)])


def opened_case(rng: random.Random, kind: str) -> Case:
    """An output that opens with (optional whitespace and) the start tag."""
    opening = rng.choice(LEADING_WHITESPACE) + START
    reasoning = "" if kind == "empty thinking" else thinking_text(rng)
    if kind == "no end tag":
        return Case(kind, opening + reasoning, reasoning, "", None)
    content = answer_text(rng)
    answer_start = len(opening) + len(reasoning) + len(END)
    return Case(kind, opening + reasoning + END + content, reasoning, content, answer_start)


def qwen3_case(rng: random.Random) -> Case:
    kind = rng.choice(["thinking", "thinking", "empty thinking", "no end tag", "no start tag", "no start tag"])
    if kind != "no start tag":
        return opened_case(rng, kind)
    while (content := rng.choice(LEADING_WHITESPACE) + random_text(rng)).lstrip().startswith(START):
        pass
    # The answer is known to have begun at the first character that cannot continue "<think>".
    stripped = content.lstrip()
    diverges_at = next((k for k in range(len(stripped)) if not START.startswith(stripped[:k + 1])), None)
    answer_start = None if diverges_at is None else len(content) - len(stripped) + diverges_at + 1
    return Case(kind, content, None, content, answer_start)


def deepseek_r1_case(rng: random.Random) -> Case:
    kind = rng.choice(["implicit thinking", "implicit thinking", "thinking", "empty thinking",
                       "implicit empty thinking", "no end tag", "implicit, no end tag"])
    if not kind.startswith("implicit"):
        return opened_case(rng, kind)
    while (reasoning := "" if kind == "implicit empty thinking" else thinking_text(rng)).lstrip().startswith(START):
        pass
    if kind == "implicit, no end tag":
        return Case(kind, reasoning, reasoning, "", None)
    content = answer_text(rng)
    return Case(kind, reasoning + END + content, reasoning, content, len(reasoning) + len(END))


def generate(name: str) -> list[Case]:
    rng = random.Random(f"reasoning-{name}")
    make = {"qwen3": qwen3_case, "deepseek_r1": deepseek_r1_case}[name]
    return [make(rng) for _ in range(NUM_CASES_PER_PARSER)]


CASES = [(name, index, case) for name in ("qwen3", "deepseek_r1") for index, case in enumerate(generate(name))]


@pytest.fixture(scope="module")
def demo_tokenizer():
    from quire.core.demo import demo_model_path
    from quire.core.tokenizer import load_tokenizer

    return load_tokenizer(str(demo_model_path()))


def stream(parser: ReasoningParser, chunks) -> tuple[str, str]:
    reasoning, content = "", ""
    for delta in [*(parser.extract_delta(chunk) for chunk in chunks), parser.finish()]:
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    return reasoning, content


def expected_stream(case: Case) -> tuple[str, str]:
    return case.reasoning or "", case.content


@pytest.mark.parametrize("name,index,case", CASES, ids=[f"{n}-{i}-{c.kind}" for n, i, c in CASES])
def test_whole_and_character_chunked_output_split_into_the_known_parts(name, index, case):
    parser_class = get_reasoning_parser_class(name)
    assert parser_class().extract(case.text) == (case.reasoning, case.content)
    rng = random.Random(f"{name}-{index}")
    for _ in range(3):
        num_cuts = min(rng.randint(0, 6), max(len(case.text) - 1, 0))
        cuts = sorted(rng.sample(range(1, len(case.text)), num_cuts))
        chunks = [case.text[start:end] for start, end in zip([0, *cuts], [*cuts, len(case.text)])]
        assert stream(parser_class(), chunks) == expected_stream(case), chunks
    assert stream(parser_class(), list(case.text)) == expected_stream(case)
    parser = parser_class()
    ended = [parser.is_reasoning_end(case.text[:length]) for length in range(len(case.text) + 1)]
    expected = [case.answer_start is not None and length >= case.answer_start for length in range(len(ended))]
    assert ended == expected


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_token_by_token_through_the_detokenizer(demo_tokenizer, name):
    from quire.core.engine.detokenizer import IncrementalDetokenizer
    from quire.core.sampling_params import SamplingParams

    prompt_ids = demo_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for _, index, case in (c for c in CASES if c[0] == name):
        token_ids = demo_tokenizer.encode(case.text, add_special_tokens=False)
        assert demo_tokenizer.decode(token_ids) == case.text
        parser, detokenizer = get_reasoning_parser_class(name)(), IncrementalDetokenizer(
            demo_tokenizer, prompt_ids, SamplingParams())
        deltas: list[ReasoningDelta] = []
        for token_id in token_ids:
            detokenizer.update([token_id], stop_terminated=False)
            deltas.append(parser.extract_delta(detokenizer.next_text(finished=False, delta=True)))
            output_text = detokenizer.output_text
            has_answer_begun = case.answer_start is not None and len(output_text) >= case.answer_start
            assert parser.is_reasoning_end(output_text) == has_answer_begun, (index, output_text)
        detokenizer.finish(stop_terminated=False)
        deltas += [parser.extract_delta(detokenizer.next_text(finished=True, delta=True)), parser.finish()]
        streamed = ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))
        assert streamed == expected_stream(case), (index, case)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_the_generated_outputs_cover_every_kind_and_the_tricky_text(name):
    cases = [case for case_name, _, case in CASES if case_name == name]
    assert len(cases) >= 50
    kinds = {case.kind for case in cases}
    assert {"thinking", "empty thinking", "no end tag"} <= kinds
    assert ("no start tag" in kinds) if name == "qwen3" else {"implicit thinking", "implicit, no end tag"} <= kinds
    texts = [(case.reasoning or "") + "\x00" + case.content for case in cases]
    for needle in ["</thi", "<", "\n", "中文", "😀"]:
        assert any(needle in text.split("\x00")[0] for text in texts), needle
        assert any(needle in text.split("\x00")[1] for text in texts), needle


def test_qwen3_decisions():
    parser = Qwen3ReasoningParser()
    assert parser.extract("\n<think>\nplan\n</think>\n\nanswer") == ("\nplan\n", "\n\nanswer")
    assert parser.extract("<think></think>answer") == ("", "answer")
    assert parser.extract("answer <think>x</think>") == (None, "answer <think>x</think>")
    assert parser.extract("<think>cut by length") == ("cut by length", "")
    assert parser.extract("<thi") == (None, "<thi")
    assert [parser.is_reasoning_end(text) for text in ["", "\n", "<thi", "<thix", "{", "<think>a", "<think></think>"]] \
        == [False, False, False, True, True, False, True]


def test_deepseek_r1_decisions():
    parser = DeepSeekR1ReasoningParser()
    assert parser.extract("plan</think>\n\nanswer") == ("plan", "\n\nanswer")
    assert parser.extract("<think>plan</think>answer") == ("plan", "answer")
    assert parser.extract("plan, cut by length") == ("plan, cut by length", "")
    assert parser.extract("") == ("", "")
    assert [parser.is_reasoning_end(text) for text in ["", "{", "plan</think", "plan</think>"]] \
        == [False, False, False, True]


def test_partial_tags_are_held_back_until_resolved():
    parser = Qwen3ReasoningParser()
    assert parser.extract_delta("\n<th") == ReasoningDelta()
    assert parser.extract_delta("ink>a</thi") == ReasoningDelta(reasoning="a")
    assert parser.extract_delta("s") == ReasoningDelta(reasoning="</this")
    assert parser.extract_delta("</think>\n\nb") == ReasoningDelta(content="\n\nb")
    assert parser.finish() == ReasoningDelta()
    parser = DeepSeekR1ReasoningParser()
    assert parser.extract_delta("x</think") == ReasoningDelta(reasoning="x")
    assert parser.finish() == ReasoningDelta(reasoning="</think")


def test_registry_names_the_parsers_and_rejects_unknown_ones():
    assert REASONING_PARSERS.names() == ["deepseek_r1", "qwen3"]
    for name in REASONING_PARSERS.names():
        parser_class = get_reasoning_parser_class(name)
        assert parser_class.name == name and parser_class.end_tag == END
    with pytest.raises(ConfigError, match="unknown reasoning parser 'nope'.*deepseek_r1, qwen3"):
        get_reasoning_parser_class("nope")
