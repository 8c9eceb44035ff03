"""Malformed tool requests are 400s naming the field, decided in the front end (none reaches the engine
core); well-formed ones reach the chat template. In-process: an AsyncLLM on quire-demo behind the app,
with the hermes tool parser."""

from __future__ import annotations

import pytest

from quire.core.demo import demo_model_path
from quire.core.engine_args import EngineArgs
from quire.core.errors import ValidationError
from quire.core.renderer import ChatPrompt, Renderer
from quire.core.tokenizer import load_tokenizer
from quire.openai_server.settings import ServerSettings
from tests.in_process_app import counting_app

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "What does os.getcwd do?"}
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "A docstring", "parameters": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}}, "required": ["name"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"name": "os.getcwd"}'}}

CASES = [
    # (extra body fields, param named in the error)
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [LOOKUP], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "search"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [LOOKUP, LOOKUP]}, "tools"),
    ({"tools": [LOOKUP], "messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"tools": [LOOKUP], "messages": [USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[1].tool_calls[0].id"),
    ({"tools": [LOOKUP], "messages": [USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "lookup", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": [LOOKUP], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tool_choice"),
]


@pytest.fixture(scope="module")
def app_and_calls():
    settings = ServerSettings(served_model_names=["quire-demo"], tool_call_parser="hermes")
    with counting_app(EngineArgs(dtype="float32", tool_call_parser="hermes"), settings) as client_and_calls:
        yield client_and_calls


def test_there_are_at_least_10_refusals():
    assert len(CASES) >= 10


@pytest.mark.parametrize("extra,param", CASES)
def test_a_malformed_tool_request_is_a_400_naming_the_field(app_and_calls, extra, param):
    client, calls = app_and_calls
    before = len(calls)
    response = client.post(CHAT, json={"messages": [USER], "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    assert len(calls) == before, "a refused request reached the engine core"


def test_a_tool_round_trip_reaches_the_engine(app_and_calls):
    client, calls = app_and_calls
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Return a string of the current directory."}]
    response = client.post(CHAT, json={"messages": messages, "tools": [LOOKUP], "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert calls[-1].sampling_params.structured_outputs is None  # auto: parsed, not constrained


def test_auto_needs_a_tool_parser():
    from quire.offline import LLM

    llm = LLM(dtype="float32", multiprocess=False)
    with pytest.raises(ValidationError) as refused:
        llm.chat([USER], tools=[LOOKUP], use_tqdm=False)
    assert refused.value.param == "tool_choice" and "--tool-call-parser" in refused.value.message
    llm.shutdown()


def test_tools_and_calls_reach_the_template():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.name }}:{{ c.function.arguments.name }}>"
                "{% endfor %}{{ m.content }}|{% endfor %}")
    renderer = Renderer(load_tokenizer(str(demo_model_path())), 4096)
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "cwd"}]
    rendered = renderer.render_chat(ChatPrompt(messages, chat_template=template, tools=[LOOKUP]))
    # the arguments reach the template as an object, as Hugging Face templates expect
    assert rendered.text == "[lookup]What does os.getcwd do?|<lookup:os.getcwd>|cwd|"
