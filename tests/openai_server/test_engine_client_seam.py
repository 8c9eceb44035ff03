"""The server touches its engine only through ``EngineClient``: its routes run against a fake client that
has nothing but the protocol's members, and no module of the server or the CLI reads an engine attribute
the protocol does not declare."""

import ast
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from quire.core.config import ModelConfig
from quire.core.engine.protocol import EngineClient, OutputStream
from quire.core.tokenizer import load_tokenizer
from quire.openai_server.app import build_app
from quire.openai_server.settings import ServerSettings
from tests.openai_server.fake_engine import FakeEngineClient, protocol_members

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (40, 41, 42, 43)


@pytest.fixture(scope="module")
def fake(llama_checkpoint):
    return FakeEngineClient(ModelConfig.from_hf(llama_checkpoint), load_tokenizer(str(llama_checkpoint)),
                            max_model_len=128, script=SCRIPT)


@pytest.fixture(scope="module")
def client(fake):
    app = build_app(fake, ServerSettings(served_model_names=["fake"], enable_debug_routes=True))
    with TestClient(app) as test_client:
        yield test_client


def test_the_fake_has_only_the_protocols_members(fake):
    assert isinstance(fake, EngineClient)
    public = {name for name in dir(fake) if not name.startswith("_")}
    assert public <= protocol_members(EngineClient), public - protocol_members(EngineClient)


def test_completions_through_the_protocol(client, fake):
    text = fake.renderer.detokenize(list(SCRIPT))
    body = client.post("/v1/completions", json={"prompt": ["import os", "x"], "max_tokens": 4,
                                                "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == ["import os" + text, "x" + text]
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(fake.renderer.tokenize("import os")) + len(fake.renderer.tokenize("x"))
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "echo": True}).json()
    assert ids["choices"][0]["text"] == fake.renderer.detokenize([5, 6, 7]) + fake.renderer.detokenize(list(SCRIPT[:2]))
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == fake.renderer.detokenize(list(SCRIPT[:3]))
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_through_the_protocol(client, fake):
    messages = [{"role": "user", "content": "hi"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "n": 2,
                                                     "temperature": 1}).json()
    assert [c["message"]["content"] for c in body["choices"]] == [fake.renderer.detokenize(list(SCRIPT[:2]))] * 2
    tokenized = client.post("/tokenize", json={"messages": messages}).json()
    assert body["usage"]["prompt_tokens"] == tokenized["count"]
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "stream": True,
                                                               "max_tokens": 4}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == fake.renderer.detokenize(
        list(SCRIPT))


def test_service_routes_through_the_protocol(client, fake):
    tokens = client.post("/tokenize", json={"prompt": "import os", "return_token_strs": True}).json()
    assert tokens["tokens"] == fake.renderer.tokenize("import os") and tokens["max_model_len"] == 128
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "import os"
    assert client.get("/tokenizer_info").json()["model_max_length"] == 128
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 128
    assert client.get("/health").status_code == 200
    assert client.get("/debug/state").json()["front_end"]["http_requests_in_flight"] == 1  # this request
    assert client.get("/debug/step_timings").json() == {"num_steps": 0}
    assert client.post("/debug/check_idle").json() == {"idle": True}


def test_input_errors_come_from_the_engines_input_path(client):
    too_long = client.post("/v1/completions", json={"prompt": list(range(5, 200))})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in too_long.json()["error"]["message"]
    bad_token = client.post("/detokenize", json={"tokens": [10**6]})
    assert bad_token.status_code == 400 and bad_token.json()["error"]["param"] == "tokens"
    both = client.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "a"}],
                                                     "add_generation_prompt": True, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def _engine_attribute_reads(path: Path) -> set[str]:
    """Attributes read off anything named ``engine`` (a variable, ``state.engine``, ``self.engine``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "engine") or (
                    isinstance(base, ast.Attribute) and base.attr == "engine"):
                names.add(node.attr)
    return names


@pytest.mark.parametrize("package", ["openai-server", "cli"])
def test_front_ends_read_only_protocol_members(package):
    allowed = protocol_members(EngineClient) | protocol_members(OutputStream)
    reads = set()
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        reads |= {(path.name, name) for name in _engine_attribute_reads(path)}
    outside = {(file, name) for file, name in reads if name not in allowed}
    assert not outside, f"engine attributes outside the protocol: {sorted(outside)}"
    if package == "openai-server":
        assert {name for _, name in reads} >= {"add_request", "renderer", "errored"}  # the check sees reads
