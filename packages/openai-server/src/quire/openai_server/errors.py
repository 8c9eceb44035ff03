"""Every error the server returns, mapped from exceptions in this one place.

Bodies are ``{"error": {"message", "type", "param", "code"}}`` with string codes. Messages never carry
stack traces or server paths: unexpected exceptions become a generic 500.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quire.core.errors import (
    EngineDeadError,
    EngineGenerateError,
    NotFoundError,
    OverloadedError,
    QuireError,
    RequestTimeoutError,
    ValidationError,
)

logger = logging.getLogger(__name__)
_PATH = re.compile(r"(?:/[\w.\-]+){2,}")


class APIError(Exception):
    """An error the API answers with a given status, type and code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str = "invalid_value", param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}


def error_body(message: str, type: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": _PATH.sub("<path>", message), "type": type, "param": param, "code": code}}


def to_api_error(error: BaseException) -> APIError:
    """The API's view of any exception (also used for errors inside a started stream)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValidationError):
        return APIError(400, error.message, code=error.code, param=error.param)
    if isinstance(error, NotFoundError):
        return APIError(404, str(error), code="not_found")
    if isinstance(error, OverloadedError):
        return APIError(503, str(error), type="server_error", code="server_overloaded",
                        headers={"Retry-After": str(error.retry_after_seconds)})
    if isinstance(error, EngineDeadError):
        return APIError(500, "the inference engine has stopped; this server cannot serve requests",
                        type="server_error", code="engine_dead")
    if isinstance(error, RequestTimeoutError):
        return APIError(504, str(error), type="server_error", code="request_timeout")
    if isinstance(error, EngineGenerateError):
        return APIError(500, "the engine failed to generate for this request", type="server_error",
                        code="generation_failed")
    if isinstance(error, QuireError):
        return APIError(500, "internal server error", type="server_error", code="internal_error")
    logger.exception("unexpected error", exc_info=error)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def error_response(error: BaseException) -> JSONResponse:
    api_error = to_api_error(error)
    return JSONResponse(error_body(api_error.message, api_error.type, api_error.code, api_error.param),
                        status_code=api_error.status, headers=api_error.headers)


def stream_error_event(error: BaseException) -> bytes:
    """An error after a stream started: one ``data:`` event carrying the error body."""
    api_error = to_api_error(error)
    body = error_body(api_error.message, api_error.type, api_error.code, api_error.param)
    return f"data: {json.dumps(body)}\n\n".encode()


def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    errors = error.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    if first.get("type") == "json_invalid":
        return error_response(APIError(400, "the request body is not valid JSON", code="invalid_json"))
    param = ".".join(location) or None
    kind = first.get("type", "")
    code = "missing_required_parameter" if kind == "missing" else "invalid_type"
    if param is None:
        return error_response(APIError(400, "the request body must be a JSON object (sent with Content-Type: "
                                            "application/json)", code="invalid_type"))
    message = f"{param}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_response(APIError(400, message, code=code, param=param))


def _is_type_tag(part) -> bool:
    # pydantic names the member of a union it tried ("str", "list[int]", "function-after[...]")
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "is-instance"}


def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed", 415: "unsupported_media_type"}
    return error_response(APIError(error.status_code, str(error.detail),
                                   code=codes.get(error.status_code, "http_error")))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # Expected errors are answered where they happen; anything else is a logged 500.
    for expected in (APIError, QuireError):
        app.add_exception_handler(expected, lambda request, error: error_response(error))
    app.add_exception_handler(Exception, lambda request, error: error_response(error))
