"""The request fields that constrain an output, mapped onto one ``StructuredOutputsParams``.

Accepted, as vLLM accepts them: ``response_format`` (``text``, ``json_object``, ``json_schema`` with
``strict``, ``structural_tag``), the ``structured_outputs`` object, and the older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with ``guided_decoding_backend``). A request may
set one constraint; errors name the field the client sent (not the engine's name for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from quire.core.errors import ValidationError
from quire.core.sampling_params import CONSTRAINT_KINDS, StructuredOutputsParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS_KEYS = (*CONSTRAINT_KINDS, "backend", "disable_any_whitespace")


class Constraint:
    """A request's constraint and the field it came from (``source``), for naming it in errors."""

    def __init__(self, params: StructuredOutputsParams, source: str):
        self.params = params
        self.source = source


def constraint_from_request(body: Any) -> Constraint | None:
    """The one constraint a request sets, or None; ``ValidationError`` (naming the field) otherwise."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        entry = _from_response_format(response_format)
        if entry is not None:
            found.append(entry)
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, {kind: value}))
    if len(found) > 1:
        names = [source.split(".")[0] for source, _ in found]
        raise ValidationError(f"a request may set one structured-output constraint; got {' and '.join(names)}",
                              param=names[1])
    if body.guided_decoding_backend is not None:
        if not found or not found[0][0].startswith("guided_"):
            raise ValidationError("guided_decoding_backend needs one of " + ", ".join(_GUIDED_FIELDS),
                                  param="guided_decoding_backend")
        found[0][1]["backend"] = body.guided_decoding_backend
    if not found:
        return None
    source, fields = found[0]
    with naming_errors(source):
        return Constraint(StructuredOutputsParams(**fields), source)


@contextlib.contextmanager
def naming_errors(source: str | None) -> Iterator[None]:
    """Rename the engine's ``structured_outputs.<field>`` in a ``ValidationError`` to the request's field."""
    try:
        yield
    except ValidationError as error:
        if source is None or not (error.param or "").startswith("structured_outputs"):
            raise
        param = _source_param(source, error.param)
        message = error.message.replace(error.param, param) if error.param in error.message else error.message
        raise ValidationError(message, param=param, code=error.code) from None


def _source_param(source: str, engine_param: str) -> str:
    if source == "structured_outputs":
        return engine_param
    if source.startswith("guided_") and engine_param.endswith(".backend"):
        return "guided_decoding_backend"
    return source


def _from_response_format(value: Any) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(value, dict):
        raise ValidationError("response_format must be an object", param="response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError("response_format.json_schema must be an object with a schema",
                                  param="response_format.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValidationError("response_format.json_schema.schema must be a JSON schema object",
                                  param="response_format.json_schema.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValidationError("response_format.json_schema.strict must be a boolean",
                                  param="response_format.json_schema.strict")
        # NOTE: strict or not, the schema is enforced (and no properties beyond those it names are made).
        return "response_format.json_schema.schema", {"json": schema}
    if kind == "structural_tag":
        tag = {key: item for key, item in value.items() if key != "type"}
        tag = value if "format" in value else tag
        return "response_format", {"structural_tag": tag}
    raise ValidationError(f"response_format.type must be text, json_object, json_schema or structural_tag; "
                          f"got {kind!r}", param="response_format.type", code="unsupported_value")


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValidationError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise ValidationError(f"structured_outputs has unknown fields: {', '.join(unknown)} (known: "
                              f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})", param=f"structured_outputs.{unknown[0]}")
    return {key: item for key, item in value.items() if item is not None}
