"""The generation routes' short path: what FastAPI's request handling does for ``POST /v1/completions`` and
``POST /v1/chat/completions``, without its per-request machinery.

FastAPI answers every request through a dozen layers (its error, telemetry, body-limit and exit-stack
middlewares, the router, dependency solving, the handler that reads and parses the body, the response-model
serialization): ~180 us of a request's CPU on the machines measured, more than the rest of a short request's
front-end work. The generation routes are where a server's requests are, so ``ShortGenerationPath`` answers
them itself, through the same parts: the app's own middleware (``ServerMiddleware``, CORS), the route's body
field and response field (so the same validation errors and the same JSON), the route's endpoint function, and
the app's exception handlers. Every other request, and these routes under a ``root_path``, go through FastAPI.
"""

from __future__ import annotations

import email.message
import inspect
import json

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError, ResponseValidationError
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_MISSING_BODY = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}


class ShortGenerationPath:
    """An ASGI app for the generation routes of ``app`` (built once its routes and middleware are all in)."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.routes = {route.path: route for route in _generation_routes(app)}
        stack = self._answer
        for middleware_class, args, kwargs in reversed(app.user_middleware):  # as Starlette stacks them
            stack = middleware_class(stack, *args, **kwargs)
        self._stack = stack

    @classmethod
    def for_app(cls, app: FastAPI) -> ShortGenerationPath | None:
        """The short path, or None where this FastAPI's routes lack what it uses (FastAPI then answers)."""
        routes = _generation_routes(app)
        if not routes or not all(_fits(route) for route in routes):
            return None
        return cls(app)

    def handles(self, scope) -> bool:
        return (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.routes
                and not scope.get("root_path"))

    async def __call__(self, scope, receive, send) -> None:
        scope["app"] = self.app
        await self._stack(scope, receive, send)

    async def _answer(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        try:
            response = await self._respond(self.routes[scope["path"]], request)
        except Exception as error:  # noqa: BLE001 - answered by the app's handlers, as FastAPI would
            response, unexpected = await self._handle(request, error)
            if unexpected:  # Starlette's ServerErrorMiddleware: the 500, then the error goes on to the server
                await response(scope, receive, send)
                raise
        await response(scope, receive, send)

    async def _respond(self, route: APIRoute, request: Request) -> Response:
        body = await _json_body(request)
        if body is _UNDEFINED:
            raise RequestValidationError([dict(_MISSING_BODY)])
        value, errors = route.body_field.validate(body, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=body)
        result = await route.endpoint(**{route.body_field.name: value, "request": request})
        if isinstance(result, Response):
            return result
        field = route.response_field
        value, errors = field.validate(result, {}, loc=("response",))
        if errors:
            raise ResponseValidationError(errors=errors, body=result)
        return Response(field.serialize_json(value, by_alias=True), media_type="application/json")

    async def _handle(self, request: Request, error: Exception) -> tuple[Response, bool]:
        """The app's answer to ``error`` and whether it was unexpected (no handler below the 500 one)."""
        handlers = self.app.exception_handlers
        handler = handlers.get(error.status_code) if isinstance(error, HTTPException) else None
        if handler is None:
            handler = next((handlers[kind] for kind in type(error).__mro__
                            if kind in handlers and kind is not Exception), None)
        unexpected = handler is None
        if unexpected:
            handler = handlers.get(500) or handlers.get(Exception)
            if handler is None:
                return PlainTextResponse("Internal Server Error", status_code=500), True
        response = handler(request, error)
        if inspect.isawaitable(response):
            response = await response
        return response, unexpected


_UNDEFINED = object()
_decode_json = msgspec.json.Decoder().decode  # the values json.loads gives, for all it accepts (floats, big ints)


def _generation_routes(app: FastAPI) -> list[APIRoute]:
    return [route for route in app.routes
            if isinstance(route, APIRoute) and route.path in GENERATION_PATHS and "POST" in route.methods]


def _fits(route: APIRoute) -> bool:
    """The route takes its body and the request, nothing else, and has the fields this path uses."""
    body_field, response_field = getattr(route, "body_field", None), getattr(route, "response_field", None)
    return (hasattr(body_field, "validate") and hasattr(response_field, "serialize_json")
            and list(inspect.signature(route.endpoint).parameters) == [body_field.name, "request"])


async def _json_body(request: Request):
    """The body as FastAPI reads it for a JSON body parameter: the parsed JSON under a JSON content type, the
    bytes under any other (or none: FastAPI's strict content type), undefined when empty."""
    try:
        raw = await request.body()
    except Exception as error:  # noqa: BLE001 - a client gone mid-body, as FastAPI words it
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from error
    if not raw:
        return _UNDEFINED
    content_type = request.headers.get("content-type")
    if not content_type or not _is_json(content_type):
        return raw
    try:  # msgspec first (about three times faster); whatever it refuses, json reads or words the error for
        return _decode_json(raw)
    except msgspec.DecodeError:
        pass
    try:
        return json.loads(raw)
    except json.JSONDecodeError as error:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": error.msg}}], body=error.doc) from error
    except Exception as error:  # noqa: BLE001 - bytes that are not text
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from error


def _is_json(content_type: str) -> bool:
    if content_type == "application/json":
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
