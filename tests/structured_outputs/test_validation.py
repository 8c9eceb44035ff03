"""Constraints that cannot be enforced exactly are 400s naming the field the client sent, decided in the
front end: none of them reaches the engine core. In-process (an AsyncLLM on quire-demo behind the app)."""

from __future__ import annotations

import time

import pytest

from quire.core.engine_args import EngineArgs
from quire.core.errors import ValidationError
from quire.core.sampling_params import StructuredOutputsParams
from quire.core.structured_outputs import backends
from quire.core.structured_outputs.backends import StructuredOutputBackend
from quire.core.structured_outputs.validation import StructuredOutputValidator
from quire.openai_server.settings import ServerSettings
from tests.in_process_app import counting_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}

CASES = [
    # (path, extra body fields, param named in the error, words the message must contain)
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}}},
     "response_format.json_schema.schema", "uniqueItems"),
    (CHAT, {"guided_json": {"not": {"type": "string"}}}, "guided_json", "not"),
    (CHAT, {"structured_outputs": {"json": {"type": "string", "format": "zip-code"}}}, "structured_outputs.json",
     "zip-code"),
    (CHAT, {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    (CHAT, {"guided_json": {"if": {"type": "string"}, "then": {"minLength": 2}}}, "guided_json", "if"),
    (CHAT, {"guided_regex": "("}, "guided_regex", "regex"),
    (CHAT, {"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "regex"),
    (CHAT, {"guided_regex": r"(a)\1"}, "guided_regex", "regex"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "one"),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    (CHAT, {"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend",
     "outlines"),
    (CHAT, {"guided_choice": ["a", "b"], "guided_decoding_backend": "lmformat"}, "guided_decoding_backend",
     "lmformat"),
    (CHAT, {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "guided_"),
    (CHAT, {"guided_choice": []}, "guided_choice", "non-empty"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    (CHAT, {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "unknown"),
    (CHAT, {"structured_outputs": {"grammar": "root ::= (", "backend": "xgrammar"}}, "structured_outputs.grammar",
     "xgrammar"),
    (CHAT, {"structured_outputs": {"structural_tag": {"structures": [], "triggers": []}, "backend": "guidance"}},
     "structured_outputs.structural_tag", "xgrammar"),
    (C, {"guided_regex": "[a-"}, "guided_regex", "regex"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                                                                               "propertyNames": {"maxLength": 2}}}}},
     "response_format.json_schema.schema", "propertyNames"),
]


@pytest.fixture(scope="module")
def app_and_calls():
    settings = ServerSettings(served_model_names=["quire-demo"])
    with counting_app(EngineArgs(dtype="float32"), settings) as client_and_calls:
        yield client_and_calls


def test_there_are_at_least_12_refusals():
    assert len(CASES) >= 12


@pytest.mark.parametrize("path,extra,param,words", CASES)
def test_an_unenforceable_constraint_is_a_400_naming_the_field(app_and_calls, path, extra, param, words):
    client, calls = app_and_calls
    before = len(calls)
    body = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    response = client.post(path, json={**body, "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error
    assert len(calls) == before, "a refused request reached the engine core"


def test_an_enforceable_constraint_does_reach_the_engine(app_and_calls):
    client, calls = app_and_calls
    before = len(calls)
    response = client.post(CHAT, json={"messages": MSG, "max_tokens": 8, "guided_choice": ["yes", "no"]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert len(calls) == before + 1
    assert calls[-1].sampling_params.structured_outputs.backend == "xgrammar"  # auto, resolved in the front end


def test_auto_falls_back_to_guidance_for_what_only_guidance_enforces():
    # xgrammar refuses minProperties above the named properties in strict mode; llguidance enforces it
    schema = {"type": "object", "minProperties": 1}
    validator = StructuredOutputValidator("auto")
    assert validator.validate(StructuredOutputsParams(json=schema)).backend == "guidance"
    with pytest.raises(ValidationError) as refused:
        StructuredOutputValidator("xgrammar").validate(StructuredOutputsParams(json=schema))
    assert refused.value.param == "structured_outputs.json" and "minProperties" in refused.value.message


class SlowBackend(StructuredOutputBackend):
    name = "slow"

    @classmethod
    def validate(cls, kind, spec, compact):
        time.sleep(2.0)

    def compile(self, kind, spec, compact):
        raise NotImplementedError


def test_a_check_that_takes_too_long_is_refused_not_waited_for(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS.entries, "xgrammar", (__name__, "SlowBackend"))
    validator = StructuredOutputValidator("xgrammar", timeout=0.2)
    with pytest.raises(ValidationError) as refused:  # refused by the timeout, not after the 2 s check
        validator.validate(StructuredOutputsParams(regex="a+"))
    assert refused.value.param == "structured_outputs.regex" and "longer than" in refused.value.message


def test_offline_refusals_name_the_field():
    with pytest.raises(ValidationError) as refused:
        StructuredOutputsParams(json={"type": "string"}, regex="a")
    assert refused.value.param == "structured_outputs"
    with pytest.raises(ValidationError) as refused:
        StructuredOutputValidator().validate(StructuredOutputsParams(regex="[a-"))
    assert refused.value.param == "structured_outputs.regex"
