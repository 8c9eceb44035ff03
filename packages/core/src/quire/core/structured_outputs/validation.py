"""The front end's check of a request's constraint, before the request is admitted.

It resolves the backend (the request's, else the engine's; ``auto`` takes xgrammar and falls back to
guidance for what only guidance supports) and asks that backend whether it can enforce the constraint
exactly. Verdicts are cached by constraint, so a schema is checked once. A check that takes longer than
``timeout`` seconds (a pathological regex or schema) is refused rather than waited for.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict

import msgspec

from quire.core.errors import ValidationError
from quire.core.sampling_params import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsParams
from quire.core.structured_outputs.backends import get_backend_class

VALIDATION_TIMEOUT_SECONDS = 5.0
_CACHE_SIZE = 1024


class StructuredOutputValidator:
    """``validate(params)`` returns the params with ``backend`` resolved, or raises ``ValidationError``."""

    def __init__(self, default_backend: str = "auto", timeout: float = VALIDATION_TIMEOUT_SECONDS):
        if default_backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}")
        self.default_backend = default_backend
        self.timeout = timeout
        self._verdicts: OrderedDict[tuple, ValidationError | None] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def validate(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        kind, spec = params.kind, params.spec
        if kind in ("json", "structural_tag"):
            _check_json_object(kind, spec)
        requested = params.backend or self.default_backend
        candidates = ("xgrammar", "guidance") if requested == "auto" else (requested,)
        first_error = None
        for backend in candidates:
            error = self._verdict(backend, kind, spec, params.disable_any_whitespace)
            if error is None:
                return params if params.backend == backend else msgspec.structs.replace(params, backend=backend)
            first_error = first_error or error
        raise ValidationError(first_error.message, param=first_error.param, code=first_error.code)

    def _verdict(self, backend: str, kind: str, spec: str, compact: bool) -> ValidationError | None:
        key = (backend, kind, spec, compact)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        error = self._check(backend, kind, spec, compact)
        with self._lock:
            self._verdicts[key] = error
            while len(self._verdicts) > _CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return error

    def _check(self, backend: str, kind: str, spec: str, compact: bool) -> ValidationError | None:
        backend_class = get_backend_class(backend)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="structured-output-check")
        future = self._pool.submit(backend_class.validate, kind, spec, compact)
        try:
            future.result(timeout=self.timeout)
        except ValidationError as error:
            return error
        except concurrent.futures.TimeoutError:
            # NOTE: the check cannot be interrupted; it finishes in the background and its verdict is dropped.
            return ValidationError(f"structured_outputs.{kind} took longer than {self.timeout:g} s to check "
                                   "and is refused; simplify it", param=f"structured_outputs.{kind}")
        return None


def _check_json_object(kind: str, spec: str) -> None:
    param = f"structured_outputs.{kind}"
    try:
        value = json.loads(spec)
    except ValueError as error:
        raise ValidationError(f"{param} is not valid JSON: {error}", param=param) from None
    if not isinstance(value, dict):
        raise ValidationError(f"{param} must be a JSON object, got {type(value).__name__}", param=param)
