"""Acceptance of structured outputs on quire-demo at temperature 1.0: 100 seeded JSON schemas, 20 regular
expressions and 10 choice lists (quire.core.testing.constraints), through /v1/chat/completions and through
``LLM.generate``. Every output that finishes with ``stop`` parses and validates (jsonschema), fully matches
its regex (``re``) or is one of its choices; every output cut by ``length`` is a valid prefix (llguidance,
not the engine's default backend); at least 95% finish with ``stop`` within 256 tokens. ``LLM.generate`` runs
with n-gram speculative decoding, so this also holds with speculation. Also the openai
SDK's ``chat.completions.parse`` / ``.stream`` with a pydantic model. ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import re
import time
from typing import Annotated, Any, Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from quire.core.testing.constraints import (
    MAX_DEPTH,
    check_choice,
    check_json,
    check_regex,
    choice_lists,
    is_valid_prefix,
    json_schemas,
    regexes,
    schema_depth,
    schema_keywords,
)

SEED = 0
MAX_TOKENS = 256
CUT_TOKENS = 12  # the budget of the prefix test
MIN_STOP_RATE = 0.95
IN_FLIGHT = 64  # concurrent requests to the server: as many as it runs at once (--max-num-seqs 64)
REQUEST_TIMEOUT_SECONDS = 120
MESSAGES = {"json": "Describe a Python object as a JSON object.",
            "regex": "Reply with a value in this format: {spec}",
            "choice": "Pick one of: {choices}."}
CHECKS = {"json": check_json, "regex": check_regex, "choice": check_choice}


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    kind: str  # json, regex, choice
    spec: Any  # a schema dict, a pattern, a list of choices

    @property
    def seed(self) -> int:
        return 1000 + self.index

    def messages(self) -> list[dict[str, str]]:
        spec = self.spec if isinstance(self.spec, str) else ""
        choices = ", ".join(self.spec) if self.kind == "choice" else ""
        return [{"role": "user", "content": MESSAGES[self.kind].format(spec=spec, choices=choices)}]


@dataclasses.dataclass(frozen=True)
class Result:
    text: str
    finish_reason: str
    num_tokens: int


def all_cases() -> list[Case]:
    specs = ([("json", s) for s in json_schemas(100, SEED)] + [("regex", r) for r in regexes(20, SEED)]
             + [("choice", c) for c in choice_lists(10, SEED)])
    return [Case(index, kind, spec) for index, (kind, spec) in enumerate(specs)]


def judge(label: str, cases: list[Case], results: list[Result]) -> None:
    """Check every result against its case, print the figures, and fail with every bad output listed."""
    assert len(results) == len(cases)
    finishes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    problems = []
    for case, result in zip(cases, results):
        finishes[case.kind][result.finish_reason] += 1
        if result.finish_reason == "stop":
            problem = CHECKS[case.kind](result.text, case.spec)
        elif result.finish_reason == "length":
            problem = None if is_valid_prefix(result.text, case.kind, case.spec) else "not a valid prefix"
            if result.num_tokens != MAX_TOKENS:
                problem = f"cut by length after {result.num_tokens} tokens"
        else:
            problem = f"finish_reason {result.finish_reason!r}"
        if problem:
            spec = json.dumps(case.spec) if case.kind == "json" else repr(case.spec)
            problems.append(f"#{case.index} {case.kind} {result.finish_reason}: {problem}\n"
                            f"    output {result.text!r}\n    spec   {spec}")
    stops = sum(counts["stop"] for counts in finishes.values())
    tokens = sorted(result.num_tokens for result in results)
    print(f"\n[{label}] stop: " + ", ".join(f"{kind} {counts['stop']}/{sum(counts.values())}"
                                          for kind, counts in finishes.items())
          + f"; overall {stops}/{len(results)} = {stops / len(results):.1%}; tokens median "
          f"{tokens[len(tokens) // 2]}, max {tokens[-1]}; {len(problems)} invalid")
    for problem in problems:
        print(problem)
    assert not problems, f"{label}: {len(problems)} invalid outputs:\n" + "\n".join(problems)
    assert stops / len(results) >= MIN_STOP_RATE, f"{label}: only {stops}/{len(results)} finished with stop"


# -- the generator ----------------------------------------------------------------------------------------


def test_generator_is_seeded_and_covers_the_listed_features():
    assert json_schemas(100, SEED) == json_schemas(100, SEED) and json_schemas(5, 1) != json_schemas(5, 2)
    assert regexes(20, SEED) == regexes(20, SEED) and choice_lists(10, SEED) == choice_lists(10, SEED)
    schemas = json_schemas(100, SEED)
    used = set().union(*(schema_keywords(schema) for schema in schemas))
    for keyword in ("type:object", "type:array", "items", "maxItems", "enum", "const", "minimum", "maximum",
                    "minLength", "maxLength", "required", "anyOf", "additionalProperties"):
        assert keyword in used, keyword
    assert not used & {"uniqueItems", "not", "if", "then", "contains", "propertyNames", "pattern", "format"}
    assert all(schema_depth(schema) <= MAX_DEPTH for schema in schemas)
    assert any(schema_depth(schema) == MAX_DEPTH for schema in schemas)
    patterns = regexes(20, SEED)
    assert len(set(patterns)) == 20
    for pattern in patterns:
        re.compile(pattern)
        # the syntax re, Rust's regex and xgrammar share; repetition bounded
        assert not re.search(r"\\[bdwsDWS1-9]|\(\?|[\^]|(?<!\\)[$*+]|\{\d+,\}", pattern.replace("[$", "[")), pattern
    lists = choice_lists(10, SEED)
    assert len(lists) == 10 and all(2 <= len(c) <= 6 and len(set(c)) == len(c) for c in lists)
    assert any(a != b and b.startswith(a) for c in lists for a in c for b in c)


def test_the_checks_accept_and_refuse_what_they_should():
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["a"]}
    assert check_json('{"a": "xy", "b": 7}', schema) is None
    assert check_json('{"a": "xy", "c": 7}', schema)  # strict: no properties beyond those named
    assert check_json('{"a": "x\x13"}', schema)  # a raw control character is not JSON
    assert check_json('{"b": 7}', schema) and check_json('{"a": "xy"', schema)
    assert is_valid_prefix('{ "a" :\n "ab', "json", schema) and is_valid_prefix('{"a": "x", "b": 5', "json", schema)
    assert not is_valid_prefix('{"a": "abcd', "json", schema) and not is_valid_prefix('{"a": "x", "b": 51', "json",
                                                                                      schema)
    assert not is_valid_prefix('{"a": "x", "c', "json", schema)
    assert not is_valid_prefix('{"a": "x\x13', "json", schema)
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])"
    assert check_regex("1999-12", date) is None and check_regex("1999-1", date)
    assert is_valid_prefix("1999-1", "regex", date) and not is_valid_prefix("1999-13", "regex", date)
    assert check_choice("yes", ["yes", "no"]) is None and check_choice("ye", ["yes", "no"])
    assert is_valid_prefix("ye", "choice", ["yes", "no"]) and not is_valid_prefix("yo", "choice", ["yes"])


# -- through the server -----------------------------------------------------------------------------------


def request_body(case: Case) -> dict[str, Any]:
    body = {"model": "quire-demo", "messages": case.messages(), "temperature": 1.0, "max_tokens": MAX_TOKENS,
            "seed": case.seed}
    if case.kind == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": f"schema_{case.index}", "schema": case.spec,
                                                   "strict": True}}
    elif case.kind == "regex":
        body["structured_outputs"] = {"regex": case.spec}
    else:
        body["guided_choice"] = case.spec  # the legacy field
    return body


def test_chat_completions_outputs_follow_their_constraints(demo_server):
    cases = all_cases()
    started = time.monotonic()
    with httpx.Client(base_url=demo_server.url("/v1"), timeout=REQUEST_TIMEOUT_SECONDS) as client:

        def send(case: Case) -> Result:
            response = client.post("/chat/completions", json=request_body(case))
            assert response.status_code == 200, (case, response.text)
            body = response.json()
            choice = body["choices"][0]
            return Result(choice["message"]["content"], choice["finish_reason"], body["usage"]["completion_tokens"])

        with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
            results = list(pool.map(send, cases, timeout=10 * REQUEST_TIMEOUT_SECONDS))
    print(f"\n[server] {len(cases)} requests in {time.monotonic() - started:.1f} s")
    judge("server", cases, results)


# -- offline ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    """With n-gram speculation on every request (the server above decodes without): proposals are cut where
    the grammar refuses them and each verified position is masked as the grammar stands after the
    proposals before it."""
    from quire.offline import LLM

    llm = LLM(dtype="float32", multiprocess=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None})
    llm.llm_engine.engine_core.engine_core.backoff.min_accepted_per_step = 0  # every request keeps speculating
    yield llm
    llm.shutdown()


def speculation_counts(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.spec_decode_counts


def generate_offline(llm, cases: list[Case], max_tokens: int) -> list[Result]:
    from quire.core.sampling_params import SamplingParams, StructuredOutputsParams

    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(case.messages(), tokenize=False, add_generation_prompt=True)
               for case in cases]
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=case.seed,
                             structured_outputs=StructuredOutputsParams(**{case.kind: case.spec}))
              for case in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # one batch: every request at once
    return [Result(out.outputs[0].text, out.outputs[0].finish_reason, len(out.outputs[0].token_ids))
            for out in outputs]


def test_llm_generate_outputs_follow_their_constraints(llm):
    cases = all_cases()
    started = time.monotonic()
    accepted_before = speculation_counts(llm).num_accepted_tokens
    results = generate_offline(llm, cases, MAX_TOKENS)
    counts = speculation_counts(llm)
    print(f"\n[offline, speculative] {len(cases)} requests in {time.monotonic() - started:.1f} s; {counts.num_drafts} "
          f"drafts, {counts.num_accepted_tokens} of {counts.num_draft_tokens} proposed tokens accepted")
    judge("offline", cases, results)
    assert counts.num_accepted_tokens > accepted_before  # the constrained outputs did speculate


def test_outputs_cut_by_length_are_valid_prefixes(llm):
    """Few outputs reach 256 tokens, so the prefix check runs here on outputs cut at a few tokens."""
    cases = [case for case in all_cases() if case.kind != "choice"]
    results = generate_offline(llm, cases, max_tokens=CUT_TOKENS)
    cut = [(case, result) for case, result in zip(cases, results) if result.finish_reason == "length"]
    print(f"\n[cut at {CUT_TOKENS} tokens] {len(cut)} of {len(cases)} outputs cut by length")
    assert len(cut) >= len(cases) // 2
    invalid = [(case.index, result.text) for case, result in cut
               if not is_valid_prefix(result.text, case.kind, case.spec) or result.num_tokens != CUT_TOKENS]
    assert not invalid, invalid


# -- the openai SDK with a pydantic model -----------------------------------------------------------------


class Book(BaseModel):
    title: str = Field(max_length=24)
    author: str = Field(min_length=1, max_length=16)
    year: int = Field(ge=1900, le=2030)
    genre: Literal["fiction", "poetry", "science", "history"]
    tags: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)
    in_print: bool


@pytest.fixture
def openai_client(demo_server):
    from openai import OpenAI

    return OpenAI(base_url=demo_server.url("/v1"), api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_SECONDS)


PARSE_MESSAGES = [{"role": "user", "content": "Describe a book about the Python json module."}]


def test_openai_sdk_parse_returns_the_pydantic_object(openai_client):
    completion = openai_client.chat.completions.parse(model="quire-demo", messages=PARSE_MESSAGES,
                                                      response_format=Book, temperature=0, max_tokens=MAX_TOKENS)
    message = completion.choices[0].message
    print(f"\n[parse] {completion.choices[0].finish_reason}: {message.content!r}")
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Book)
    assert message.parsed == Book.model_validate_json(message.content)


def test_openai_sdk_stream_returns_the_pydantic_object(openai_client):
    with openai_client.chat.completions.stream(model="quire-demo", messages=PARSE_MESSAGES, response_format=Book,
                                               temperature=1.0, seed=7, max_tokens=MAX_TOKENS) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        completion = stream.get_final_completion()
    message = completion.choices[0].message
    print(f"\n[stream] {completion.choices[0].finish_reason}: {message.content!r}")
    assert completion.choices[0].finish_reason == "stop"
    assert "".join(deltas) == message.content and len(deltas) > 1
    assert isinstance(message.parsed, Book)
    assert message.parsed == Book.model_validate_json(message.content)
