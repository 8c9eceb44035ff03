"""API keys guard every route but the liveness probes (the test walks the app's own route table), and
CORS answers only configured origins. In-process, with a fake engine client."""

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from quire.core.config import ModelConfig
from quire.core.tokenizer import load_tokenizer
from quire.openai_server.app import build_app
from quire.openai_server.middleware import UNGUARDED_PATHS
from quire.openai_server.settings import ServerSettings
from tests.openai_server.fake_engine import FakeEngineClient

KEYS = ("key-one", "key-two")


class FailingEngine(FakeEngineClient):
    """An engine client whose every request fails unexpectedly."""

    async def add_request(self, *args, **kwargs):
        raise RuntimeError("the stand-in engine generates nothing")


@pytest.fixture
def client(llama_checkpoint):
    settings = ServerSettings(served_model_names=["m"], api_keys=KEYS, allowed_origins=("https://ok.example",),
                              enable_debug_routes=True)
    engine = FailingEngine(ModelConfig.from_hf(llama_checkpoint), load_tokenizer(str(llama_checkpoint)))
    app = build_app(engine, settings)
    return TestClient(app, raise_server_exceptions=False)


def all_routes(app):
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            for method in sorted(route.methods - {"HEAD"}):
                yield method, route.path.replace("{model:path}", "m")


def test_every_route_but_the_probes_needs_a_key(client):
    routes = list(all_routes(client.app))
    assert len(routes) >= 14
    for method, path in routes:
        anonymous = client.request(method, path, json={})
        wrong = client.request(method, path, json={}, headers={"Authorization": "Bearer nope"})
        right = client.request(method, path, json={}, headers={"Authorization": f"Bearer {KEYS[1]}"})
        if path in UNGUARDED_PATHS:
            assert anonymous.status_code != 401, path
        else:
            assert anonymous.status_code == 401 and wrong.status_code == 401, (method, path)
            assert anonymous.json()["error"]["code"] == "invalid_api_key"
            assert right.status_code != 401, (method, path)
    assert {"/health", "/ping", "/version"} <= {path for _, path in routes}


def test_cors_only_for_configured_origins(client):
    preflight = {"Access-Control-Request-Method": "POST"}
    ok = client.options("/v1/completions", headers={"Origin": "https://ok.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    other = client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    plain = client.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer key-one"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_unexpected_errors_are_500_without_details(client):
    response = client.post("/v1/completions", json={"prompt": "hello"}, headers={"Authorization": "Bearer key-one"})
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal server error", "type": "server_error", "param": None,
                                        "code": "internal_error"}
