"""Pure ASGI middleware: body-size limit, API keys, request ids, draining and in-flight counting."""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid

from quire.openai_server.errors import error_body

# Routes that answer without an API key: liveness and version probes only (deny by default).
UNGUARDED_PATHS = frozenset({"/health", "/ping", "/live", "/version"})
# Routes that keep answering while the server drains (everything else gets 503).
PROBE_PATHS = UNGUARDED_PATHS | {"/metrics"}


async def _send_error(send, status: int, message: str, code: str, type: str = "invalid_request_error",
                      headers: list | None = None) -> None:
    body = json.dumps(error_body(message, type, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class ServerMiddleware:
    """One ASGI layer for the cross-cutting rules, in this order: request id, draining, API key, size.

    - ``X-Request-Id`` is echoed (or generated) on every response and kept in ``scope["request_id"]``;
    - while the model loads (no engine yet), ``/live`` answers 200, everything else 503;
    - while draining, non-probe routes answer 503;
    - with API keys set, every route except ``UNGUARDED_PATHS`` needs ``Authorization: Bearer <key>``
      (keys compared as SHA-256 digests in constant time); CORS preflights pass through;
    - bodies over ``max_request_body_bytes`` answer 413 before anything parses them (by Content-Length,
      or while reading a body sent without one).
    """

    def __init__(self, app, state):
        self.app = app
        self.state = state  # the server's ServerState: settings, draining flag, in-flight count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope["request_id"] = request_id
        path = scope["path"].rstrip("/") or "/"
        id_header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        if self.state.engine is None:
            return await _answer_loading(path, send_with_id)
        if self.state.draining and path not in PROBE_PATHS:
            return await _send_error(send_with_id, 503, "the server is shutting down", "server_shutting_down",
                                     "server_error", [(b"retry-after", b"1")])
        if not self._authorized(scope["method"], path, headers):
            return await _send_error(send_with_id, 401, "invalid or missing API key", "invalid_api_key")
        limit = self.state.settings.max_request_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_error(send_with_id, 413, f"the request body exceeds {limit} bytes",
                                     "request_too_large")
        if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_limited(receive, limit)  # no Content-Length: read it here, bounded
            if body is None:
                return await _send_error(send_with_id, 413, f"the request body exceeds {limit} bytes",
                                         "request_too_large")
            receive = _replay(body, receive)
        counted = path not in PROBE_PATHS
        self.state.num_in_flight += counted
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.state.num_in_flight -= counted

    def _authorized(self, method: str, path: str, headers: dict[str, str]) -> bool:
        digests = self.state.api_key_digests
        if not digests or path in UNGUARDED_PATHS:
            return True
        if method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers:
            return True  # a CORS preflight carries no credentials
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        return any([hmac.compare_digest(digest, known) for known in digests])  # list: no short-circuit


async def _answer_loading(path: str, send) -> None:
    if path in ("/live", "/health", "/ping"):
        status = 200 if path == "/live" else 503  # alive, not ready
        body = b'{"status": "loading"}'
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        return await send({"type": "http.response.body", "body": body})
    await _send_error(send, 503, "the model is still loading; retry shortly", "model_loading", "server_error",
                      [(b"retry-after", b"5")])


async def _read_limited(receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it exceeds ``limit`` bytes."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive):
    """A ``receive`` that yields the already-read body once, then defers to the real one (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
