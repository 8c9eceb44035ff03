"""The one typed error hierarchy of Quire; front ends map these classes to HTTP statuses in one place."""


class QuireError(Exception):
    """Base class of every error Quire raises on purpose."""


class ValidationError(QuireError, ValueError):
    """The caller's input is invalid (HTTP 400). ``param`` names the offending field; ``code`` is a
    stable machine-readable id (``invalid_value``, ``context_length_exceeded``, ``unsupported_value``…)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class NotFoundError(QuireError):
    """A named thing (model, request) does not exist (HTTP 404)."""


class OverloadedError(QuireError):
    """The engine cannot accept more work now; the caller may retry later (HTTP 503 + Retry-After)."""

    retry_after_seconds = 1


class QueueTimeoutError(OverloadedError):
    """A request waited longer than ``max_queue_time`` before it started (HTTP 503 + Retry-After)."""


class RequestTimeoutError(QuireError):
    """A request ran past its time limit and was aborted (HTTP 504)."""


class EngineDeadError(QuireError):
    """The engine core stopped and cannot serve any request (HTTP 500/503)."""


class EngineGenerateError(QuireError):
    """One request failed inside the engine; the engine itself is still healthy (HTTP 500)."""


class EngineUtilityError(QuireError):
    """A utility call to the engine core (prefix-cache reset, statistics, the idle check) failed; the
    message says why. The same type whether the engine core runs in-process or in its own process."""


class ConfigError(QuireError, ValueError):
    """The engine was configured with values it cannot run with (bad checkpoint, too little KV memory)."""
