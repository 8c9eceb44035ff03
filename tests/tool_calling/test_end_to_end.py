"""Tool calls end to end with the openai SDK, streaming and not: a required or named tool choice gives
arguments that validate against the tool's schema on every seeded request at temperature 1.0 (quire-demo,
the shared demo server); with tool_choice auto the hermes parser returns the calls a (scripted) model
writes, with finish_reason tool_calls, and the qwen3 reasoning parser puts the thinking in ``reasoning``."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from quire.core.demo import demo_model_path
from quire.core.engine.async_llm import AsyncLLM
from quire.core.engine_args import EngineArgs
from quire.core.tokenizer import load_tokenizer
from quire.openai_server.app import build_app
from quire.openai_server.settings import ServerSettings

NUM_REQUESTS = 50
LOOKUP = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 24}},
          "required": ["name"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "A function's docstring",
                                           "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"lookup": LOOKUP, "add": ADD}
MESSAGES = [{"role": "user", "content": "What does os.path.join do?"}]


@pytest.fixture(scope="module")
def client(demo_server):
    from openai import OpenAI

    return OpenAI(base_url=demo_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def streamed(client, **kwargs):
    """Merge a streamed chat completion's tool-call deltas: ({index: (id, name, arguments)}, finish)."""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call_id, name, arguments = calls.get(piece.index, (None, None, ""))
                if piece.id is not None:
                    assert call_id is None and piece.function.name, "id and name come once, first"
                    call_id, name = piece.id, piece.function.name
                calls[piece.index] = (call_id, name, arguments + (piece.function.arguments or ""))
    return calls, finish


def check_calls(calls: list[tuple[str, str]], only: str | None = None) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert only is None or name == only
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_tool_choice_always_validate(client, tool_choice, stream):
    only = None if tool_choice == "required" else "add"

    def one(seed: int):
        # one call (parallel_tool_calls false): several could run past max_tokens on a model this small
        kwargs = dict(model="quire-demo", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                      temperature=1.0, seed=seed, max_tokens=128, parallel_tool_calls=False)
        if stream:
            calls, finish = streamed(client, **kwargs)
            return [(name, arguments) for _, name, arguments in calls.values()], finish
        choice = client.chat.completions.create(**kwargs).choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], \
            choice.finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(NUM_REQUESTS)))
    for calls, finish in results:
        assert finish == "tool_calls", (calls, finish)
        assert len(calls) == 1
        check_calls(calls, only)


SCRIPT = ('<think>Which tool?</think>\n\nLet me look.<tool_call>\n{"name": "lookup", "arguments": '
          '{"name": "os.path.join"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted_app(monkeypatch_module):
    tokenizer = load_tokenizer(str(demo_model_path()))
    script = tokenizer.encode(SCRIPT, add_special_tokens=False) + [2]  # then <|im_end|>
    monkeypatch_module.setenv("QUIRE_TEST_FAULTS", "script_output=" + ".".join(map(str, script)))
    args = EngineArgs(dtype="float32", tool_call_parser="hermes", reasoning_parser="qwen3")
    engine = AsyncLLM(args.create_engine_config())
    settings = ServerSettings(served_model_names=["quire-demo"], tool_call_parser="hermes",
                              reasoning_parser="qwen3")
    with TestClient(build_app(engine, settings)) as test_client:
        yield test_client
    engine.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_auto_with_hermes_and_qwen3_reasoning(scripted_app):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200}
    message = scripted_app.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["reasoning"] == message["message"]["reasoning_content"] == "Which tool?"
    assert message["message"]["content"] == "\n\nLet me look."
    [call] = message["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"name": "os.path.join"}
    assert call["id"].startswith("call_")

    reasoning = content = arguments = ""
    names, finish = [], None
    with scripted_app.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                for piece in delta.get("tool_calls") or []:
                    if "id" in piece:
                        names.append(piece["function"]["name"])
                    arguments += piece["function"].get("arguments", "")
                finish = choice["finish_reason"] or finish
    assert (reasoning, content, names, finish) == ("Which tool?", "\n\nLet me look.", ["lookup"], "tool_calls")
    assert arguments == call["function"]["arguments"]


def test_offline_chat_returns_calls_and_reasoning(monkeypatch):
    from quire.offline import LLM, SamplingParams

    tokenizer = load_tokenizer(str(demo_model_path()))
    script = tokenizer.encode(SCRIPT, add_special_tokens=False) + [2]
    monkeypatch.setenv("QUIRE_TEST_FAULTS", "script_output=" + ".".join(map(str, script)))
    llm = LLM(dtype="float32", multiprocess=False, tool_call_parser="hermes", reasoning_parser="qwen3")
    [output] = llm.chat(MESSAGES, SamplingParams(max_tokens=200), tools=TOOLS, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.reasoning == "Which tool?" and completion.content == "\n\nLet me look."
    assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [("lookup", {"name": "os.path.join"})]
    assert completion.finish_reason == "tool_calls"
    llm.shutdown()
