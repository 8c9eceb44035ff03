"""The generation routes' short path (``ShortGenerationPath``) answers exactly as FastAPI's route does: the same
statuses, error bodies, JSON and events for well-formed and malformed requests alike, through the app's own
middleware (request ids, API keys, CORS)."""

import json

import pytest
from fastapi.testclient import TestClient

from quire.core.config import ModelConfig
from quire.core.tokenizer import load_tokenizer
from quire.openai_server.app import build_app
from quire.openai_server.settings import ServerSettings
from quire.openai_server.short_path import ShortGenerationPath
from tests.openai_server.fake_engine import FakeEngineClient

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON = "application/json"

CASES = [
    # (path, body bytes, content type or None)
    (C, b"", JSON), (C, b"", None), (C, b"null", JSON), (C, b"[1, 2, 3]", JSON), (C, b"1", JSON),
    (C, b"{not json", JSON), (C, b"\xff\xfe{", JSON), (C, b"{}", JSON),
    # JSON that msgspec refuses and json reads (or words the error for) differently
    (C, b'{"prompt": "x\ny"}', JSON), (C, b'{"prompt": "x", "max_tokens": 2,}', JSON),
    (C, b'{"prompt": "x", "temperature": NaN}', JSON), (C, b'{"prompt": "x", "temperature": 1e400}', JSON),
    (C, b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}', JSON), (C, b'{"prompt": "\\ud800", "max_tokens": 2}', JSON),
    (C, b'{"prompt": "x", "max_tokens": 2}', None),
    (C, b'{"prompt": "x", "max_tokens": 2}', "text/plain"),
    (C, b'{"prompt": "x", "max_tokens": 2}', "application/json; charset=utf-8"),
    (C, b'{"prompt": "x", "max_tokens": 2}', "Application/JSON"),
    (C, b'{"prompt": "x", "max_tokens": 2}', "application/vnd.quire+json"),
    (C, b"prompt=x", "application/x-www-form-urlencoded"),
    (C, {"prompt": 12}, JSON), (C, {"prompt": "x", "max_tokens": "many"}, JSON),
    (C, {"prompt": "x", "max_tokens": 2, "model": "nope"}, JSON), (C, {"prompt": "x", "best_of": 3}, JSON),
    (C, {"prompt": "x", "max_tokens": 100000}, JSON), (C, {"prompt": [999999]}, JSON),
    (C, {"prompt": "x", "max_tokens": 2}, JSON), (C, {"prompt": [5, 6], "max_tokens": 3, "echo": True}, JSON),
    (C, {"prompt": "x", "max_tokens": 2, "logprobs": 2}, JSON),
    (C, {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "temperature": 1}, JSON),
    (C, {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}, JSON),
    (CHAT, b"{}", JSON), (CHAT, {"messages": "hi"}, JSON), (CHAT, {"messages": MSG, "max_tokens": 2}, JSON),
    (CHAT, {"messages": MSG, "max_tokens": 3, "stream": True}, JSON),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, JSON),
]


@pytest.fixture(scope="module")
def fake(llama_checkpoint):
    return FakeEngineClient(ModelConfig.from_hf(llama_checkpoint), load_tokenizer(str(llama_checkpoint)),
                            max_model_len=128)


def _clients(fake, **settings):
    """A client of the app as served, one of the same app with the short path off, and the count of
    requests the short path answered."""
    answered = []
    short_app = build_app(fake, ServerSettings(served_model_names=["fake"], **settings))
    long_app = build_app(fake, ServerSettings(served_model_names=["fake"], **settings))
    long_app.use_short_path = False
    short_path = ShortGenerationPath.for_app(short_app)
    assert short_path is not None
    respond = short_path._respond

    async def counting(route, request):
        answered.append(route.path)
        return await respond(route, request)

    short_path._respond = counting
    short_app._short_path = short_path
    return (TestClient(short_app, raise_server_exceptions=False), TestClient(long_app, raise_server_exceptions=False),
            answered)


def _answer(client, path, body, content_type, headers=()):
    headers = {"x-request-id": "same-id", **dict(headers)}
    if content_type is not None:
        headers["content-type"] = content_type
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    response = client.post(path, content=content, headers=headers)
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        events = [json.loads(line[6:]) if line != "data: [DONE]" else line
                  for line in response.text.splitlines() if line.startswith("data: ")]
        payload = [{k: v for k, v in event.items() if k != "created"} if isinstance(event, dict) else event
                   for event in events]
    else:
        payload = response.json()
        if isinstance(payload, dict):
            payload.pop("created", None)
    return response.status_code, kind, response.headers.get("x-request-id"), payload


def test_the_short_path_answers_as_fastapi_does(fake):
    short, long, answered = _clients(fake)
    with short, long:
        for path, body, content_type in CASES:
            assert _answer(short, path, body, content_type) == _answer(long, path, body, content_type), (
                path, body, content_type)
        rank = {"x-data-parallel-rank": "abc"}
        assert _answer(short, C, {"prompt": "x"}, JSON, rank) == _answer(long, C, {"prompt": "x"}, JSON, rank)
        assert _answer(short, C, {"prompt": "x"}, JSON)[0] == 200
        assert short.get(C).status_code == long.get(C).status_code == 405  # not the short path's
    assert len(answered) == len(CASES) + 2  # every POST above went the short way


def test_the_short_path_keeps_the_apps_middleware(fake):
    short, long, answered = _clients(fake, api_keys=("sesame",), allowed_origins=("https://example.org",))
    with short, long:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer sesame"},
                        {"authorization": "Bearer sesame", "origin": "https://example.org"}):
            body = {"prompt": "x", "max_tokens": 2}
            assert _answer(short, C, body, JSON, headers) == _answer(long, C, body, JSON, headers), headers
            allowed = [client.post(C, json=body, headers=headers).headers.get("access-control-allow-origin")
                       for client in (short, long)]
            assert allowed[0] == allowed[1], headers
    assert answered == [C] * 4  # the requests with the right key (two each): the others end in the middleware


def test_an_unexpected_error_is_a_500_and_reaches_the_server(fake, monkeypatch):
    """As Starlette's ServerErrorMiddleware does: the app's 500 answer, then the error goes on to the server. (The
    short path's 500 passes the app's middleware, so it carries the request id, which ``ServerMiddleware`` puts on
    every response; FastAPI answers it outside the middleware, without.)"""
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    short, long, answered = _clients(fake)
    monkeypatch.setattr(fake, "add_request", broken)
    with short, long:
        status, kind, request_id, body = _answer(short, C, {"prompt": "x"}, JSON)
        assert (status, kind, body) == (lambda a: (a[0], a[1], a[3]))(_answer(long, C, {"prompt": "x"}, JSON))
        assert status == 500 and request_id == "same-id" and body["error"]["code"] == "internal_error"
    strict = TestClient(short.app)  # raise_server_exceptions: what reaches the server is raised here
    with strict, pytest.raises(RuntimeError, match="a bug"):
        strict.post(C, json={"prompt": "x"})
    assert answered == [C, C]
