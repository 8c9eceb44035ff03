"""Seeded constraints for structured-output tests: JSON schemas, regular expressions and choice lists, and
checks of what a constrained generation produced (``random.Random(seed)`` only: no torch, no numpy).

- ``json_schemas(count, seed)``: object schemas with nested objects and arrays (``items``, ``minItems``,
  ``maxItems``), ``enum``, ``const``, integers with ``minimum``/``maximum``, strings with
  ``minLength``/``maxLength``, ``required``, ``anyOf``, booleans and nulls; containers nest at most
  ``MAX_DEPTH`` deep. Every string and array is bounded, and a schema whose largest compact instance is
  longer than ``MAX_INSTANCE_CHARS`` is drawn again, so that a small model can finish one within a few
  hundred tokens. Only keywords every backend enforces are used (no ``pattern``, ``format``,
  ``uniqueItems``, ``not``, ``if``/``then``, ...).
- ``regexes(count, seed)``: practical patterns (dates, times, phone-like numbers, identifiers, emails,
  versions, hex colours, ...) in the syntax Python's ``re``, Rust's ``regex`` and xgrammar share: explicit
  ASCII classes (no ``\\d``/``\\w``/``\\s``), bounded repetition ``{m,n}``, groups and alternation; no
  lookarounds, backreferences, anchors or ``\\b``.
- ``choice_lists(count, seed)``: lists of 2 to 6 distinct non-empty strings; some lists hold a choice that
  is a prefix of another, some hold spaces, punctuation or non-ASCII letters.

Checking an output:

- a finished output (``finish_reason == "stop"``) is checked against an oracle independent of the grammar
  libraries: ``check_json`` (``json.loads`` + ``jsonschema``, with the strict reading below),
  ``check_regex`` (``re.fullmatch``) and ``check_choice`` (membership);
- an output cut by ``length`` must be a prefix of some valid output: ``is_valid_prefix`` runs the bytes of
  the text through an llguidance matcher over a byte-level vocabulary (llguidance is not the engine's
  default backend, xgrammar, so the check does not reuse the grammar that produced the text). For choices
  it is plain ``startswith``.

The engine's JSON schemas are strict (as OpenAI's strict mode): an object has no properties beyond those
its schema names. ``strict_schema`` states that in the schema itself (``additionalProperties: false`` on
every object schema), so that jsonschema and llguidance check the same reading.
"""

from __future__ import annotations

import copy
import json
import random
import re
from typing import Any

MAX_DEPTH = 3  # containers (objects, arrays) nest at most this deep, the top-level object counting as 1
MAX_INSTANCE_CHARS = 160  # the longest compact JSON instance a schema may allow (strings unescaped)
MAX_STRING_LENGTH = 12
MAX_ITEMS = 4

_NAMES = ("id", "name", "age", "tags", "kind", "count", "items", "user", "title", "score", "level", "owner",
          "color", "size", "mode", "active", "email", "label", "value", "status", "notes", "path", "port",
          "version", "author", "parent", "limit", "rank", "code", "city")
_WORDS = ("red", "green", "blue", "small", "large", "alpha", "beta", "open", "closed", "draft", "done", "low",
          "high", "cat", "dog", "north", "south", "python", "rust", "json", "yes", "no", "none", "auto")

# -- JSON schemas -----------------------------------------------------------------------------------------


def json_schemas(count: int = 100, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` JSON schemas, each an object schema; the same ``seed`` gives the same list."""
    rng = random.Random(seed)
    schemas: list[dict[str, Any]] = []
    while len(schemas) < count:
        schema = _object(rng, depth=1, min_properties=2)
        if max_instance_chars(schema) <= MAX_INSTANCE_CHARS:
            schemas.append(schema)
    return schemas


def _object(rng: random.Random, depth: int, min_properties: int = 1) -> dict[str, Any]:
    names = rng.sample(_NAMES, rng.randint(min_properties, 4))
    properties = {name: _value(rng, depth + 1) for name in names}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [name for name in names if rng.random() < 0.6]
    if required:
        schema["required"] = required
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    """A schema for a value whose containers (if any) start at nesting level ``depth``."""
    kinds = ["string", "string", "integer", "integer", "boolean", "enum", "const", "anyOf", "null"]
    if depth <= MAX_DEPTH:
        kinds += ["object", "array", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        # an array is a container: its items nest one level deeper
        low = rng.randint(0, 1)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low,
                "maxItems": rng.randint(max(low, 1), MAX_ITEMS)}
    if kind == "anyOf":
        branches = [_scalar(rng, kind) for kind in rng.sample(["string", "integer", "boolean", "null", "enum"],
                                                              rng.randint(2, 3))]
        if depth <= MAX_DEPTH and rng.random() < 0.3:
            branches.append(_object(rng, depth))
        return {"anyOf": branches}
    return _scalar(rng, kind)


def _scalar(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, MAX_STRING_LENGTH)}
        if rng.random() < 0.5:
            schema["minLength"] = rng.randint(0, min(3, schema["maxLength"]))
        return schema
    if kind == "integer":
        low = rng.choice([-1000, -50, -1, 0, 0, 1, 10, 100, 1900])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([1, 9, 99, 1000, 100000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        pool: list[Any] = list(_WORDS) if rng.random() < 0.7 else [0, 1, 2, 3, 5, 8, 13, -1, 42, None, True]
        values = rng.sample(pool, rng.randint(2, 5))
        if all(isinstance(value, str) for value in values) and rng.random() < 0.5:
            return {"type": "string", "enum": values}
        return {"enum": values}
    if kind == "const":
        return {"const": rng.choice([rng.choice(_WORDS), rng.randint(-5, 99), True, None, "v1.0"])}
    raise ValueError(kind)


def max_instance_chars(schema: dict[str, Any]) -> int:
    """The length of the longest compact JSON instance of a schema this module generates (a string counted
    at one character a code point, as written without escapes)."""
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    if "anyOf" in schema:
        return max(max_instance_chars(branch) for branch in schema["anyOf"])
    kind = schema["type"]
    if kind == "object":
        members = [len(json.dumps(name)) + 1 + max_instance_chars(value) for name, value in
                   schema["properties"].items()]
        return 2 + sum(members) + max(len(members) - 1, 0)
    if kind == "array":
        return 2 + schema["maxItems"] * (max_instance_chars(schema["items"]) + 1) - 1
    if kind == "string":
        return 2 + schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    return {"boolean": 5, "null": 4}[kind]


def schema_keywords(schema: Any) -> set[str]:
    """Every keyword a schema uses, at any depth (``type:<name>`` for each type), to check coverage."""
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            found.add(key)
            if key == "type":
                found.add(f"type:{value}")
            if key == "properties":
                for sub in value.values():
                    found |= schema_keywords(sub)
            elif key in ("items", "anyOf"):
                for sub in value if isinstance(value, list) else [value]:
                    found |= schema_keywords(sub)
    return found


def schema_depth(schema: dict[str, Any]) -> int:
    """How deep containers (objects, arrays) nest in a schema; a flat object is 1."""
    subs = list(schema.get("properties", {}).values()) + schema.get("anyOf", [])
    if "items" in schema:
        subs.append(schema["items"])
    inner = max((schema_depth(sub) for sub in subs), default=0)
    return inner + (1 if schema.get("type") in ("object", "array") else 0)


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` with ``additionalProperties: false`` on every object schema that names its
    properties: the engine's strict reading, made explicit for validators that default to lenient."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


# -- regular expressions ----------------------------------------------------------------------------------

_DOMAINS = ("com", "org", "net", "io", "dev")


def _date(rng: random.Random) -> str:
    sep = rng.choice(["-", "/", r"\."])
    return rf"(19|20)[0-9]{{2}}{sep}(0[1-9]|1[0-2]){sep}(0[1-9]|[12][0-9]|3[01])"


def _time(rng: random.Random) -> str:
    seconds = r"(:[0-5][0-9])?" if rng.random() < 0.5 else ""
    return rf"([01][0-9]|2[0-3]):[0-5][0-9]{seconds}"


def _phone(rng: random.Random) -> str:
    return rng.choice([r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r"\+[1-9][0-9]{0,2} [0-9]{2,4} [0-9]{3,7}",
                       r"0[1-9][0-9]{1,3}[ -][0-9]{4,8}", r"[0-9]{3}-[0-9]{3}-[0-9]{4}( x[0-9]{1,4})?"])


def _identifier(rng: random.Random) -> str:
    return rng.choice([rf"[a-z_][a-z0-9_]{{0,{rng.randint(6, 20)}}}",
                       rf"[A-Z][a-zA-Z0-9]{{1,{rng.randint(4, 16)}}}",
                       rf"[a-z]{{1,8}}(\.[a-z_]{{1,8}}){{0,{rng.randint(1, 3)}}}"])


def _email(rng: random.Random) -> str:
    domains = "|".join(rng.sample(_DOMAINS, rng.randint(1, 3)))
    return rf"[a-z][a-z0-9._]{{0,{rng.randint(5, 15)}}}@[a-z]{{1,{rng.randint(4, 10)}}}\.({domains})"


def _version(rng: random.Random) -> str:
    return rng.choice([r"v?[0-9]{1,2}\.[0-9]{1,3}\.[0-9]{1,3}", r"[0-9]\.[0-9]{1,2}(\.[0-9]{1,2})?(rc[0-9])?",
                       r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}(-(alpha|beta|rc)(\.[0-9]{1,2})?)?"])


def _hex_colour(rng: random.Random) -> str:
    return rng.choice(["#[0-9a-fA-F]{6}", "#([0-9a-f]{3}|[0-9a-f]{6})", "0x[0-9A-F]{2,8}"])


def _ipv4(rng: random.Random) -> str:
    octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    port = "(:[0-9]{2,5})?" if rng.random() < 0.5 else ""
    return rf"{octet}(\.{octet}){{3}}{port}"


def _words(rng: random.Random) -> str:
    words = "|".join(rng.sample(_WORDS, rng.randint(2, 5)))
    return rng.choice([rf"({words})( ({words})){{0,{rng.randint(1, 3)}}}",
                       rf"[A-Z][a-z]{{1,9}}( [a-z]{{1,9}}){{0,{rng.randint(1, 4)}}}[.!?]"])


def _call(rng: random.Random) -> str:
    arg = "[a-z_]{1,8}"
    return rf"(def|class) [a-z_]{{1,12}}\(({arg}(, {arg}){{0,{rng.randint(1, 3)}}})?\):"


def _amount(rng: random.Random) -> str:
    return rng.choice([r"[$€£][0-9]{1,6}(\.[0-9]{2})?", r"-?[0-9]{1,4}(\.[0-9]{1,3})? ?(kg|g|mg)",
                       r"[0-9]{1,3}(,[0-9]{3}){0,2} (USD|EUR)"])


_REGEX_FRAGMENTS = (_date, _time, _phone, _identifier, _email, _version, _hex_colour, _ipv4, _words, _call,
                    _amount)


def regexes(count: int = 20, seed: int = 0) -> list[str]:
    """``count`` distinct regular expressions; every kind of pattern above appears once ``count`` >= 11.
    Some join two fragments (e.g. a date and a time) with a separator."""
    rng = random.Random(seed)
    found: list[str] = []
    kinds = list(_REGEX_FRAGMENTS)
    rng.shuffle(kinds)
    for _ in range(100 * count):
        if len(found) == count:
            break
        kind = kinds[len(found)] if len(found) < len(kinds) else rng.choice(_REGEX_FRAGMENTS)
        pattern = kind(rng)
        if len(found) >= len(kinds) and rng.random() < 0.5:
            pattern = f"{pattern}{rng.choice([' ', ', ', ' at ', ';'])}{rng.choice(_REGEX_FRAGMENTS)(rng)}"
        re.compile(pattern)
        if pattern not in found:
            found.append(pattern)
    return found


# -- choice lists -----------------------------------------------------------------------------------------

_CHOICE_POOLS = (
    ("positive", "negative", "neutral", "mixed"),
    ("yes", "no", "yes, definitely", "no way", "maybe"),
    ("red", "green", "blue", "yellow", "purple", "orange"),
    ("def", "class", "lambda", "import", "return", "yield"),
    ("Python", "Rust", "C++", "JavaScript", "Go", "C#"),
    ("strongly agree", "agree", "disagree", "strongly disagree"),
    ("café", "naïve", "résumé", "über", "jalapeño"),
    ("1", "2", "3", "10", "12", "100"),
    ("low", "lower", "lowest", "high", "higher"),
    ("North", "South", "East", "West", "North-East", "South-West"),
    ("true", "false", "null"),
    ("list", "dict", "tuple", "set", "frozenset", "str"),
)


def choice_lists(count: int = 10, seed: int = 0) -> list[list[str]]:
    """``count`` lists of 2 to 6 distinct choices, in random order, from themed pools taken in turn (among
    the first ten: choices that are prefixes of others, spaces, punctuation and non-ASCII letters)."""
    rng = random.Random(seed)
    return [rng.sample(pool, rng.randint(2, len(pool)))
            for pool in (_CHOICE_POOLS[index % len(_CHOICE_POOLS)] for index in range(count))]


# -- checking outputs -------------------------------------------------------------------------------------


def check_json(text: str, schema: dict[str, Any]) -> str | None:
    """None if ``text`` is one JSON value that ``schema`` (read strictly) validates; else the reason."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as error:
        return f"not JSON: {error}"
    try:
        jsonschema.validate(value, strict_schema(schema))
    except jsonschema.ValidationError as error:
        return f"invalid: {error.message} at {list(error.absolute_path)}"
    return None


def check_regex(text: str, pattern: str) -> str | None:
    """None if the whole of ``text`` matches ``pattern``."""
    return None if re.fullmatch(pattern, text) else "does not fully match"


def check_choice(text: str, choices: list[str]) -> str | None:
    return None if text in choices else "not one of the choices"


class _ByteVocabulary:
    """One token per byte and an end token: the vocabulary llguidance checks raw text with."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([byte]) for byte in range(256)] + [b"<|end|>"]
    special_token_ids = [256]

    def __call__(self, data: bytes | str) -> list[int]:
        return list(data.encode() if isinstance(data, str) else data)


_TOKENIZER = None


def _byte_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        import llguidance

        _TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))
    return _TOKENIZER


def is_valid_prefix(text: str, kind: str, spec: Any) -> bool:
    """Whether ``text`` can be extended to an output that satisfies the constraint (``kind`` one of
    ``json`` with a schema dict, ``regex`` with a pattern, ``choice`` with a list). JSON allows any run of
    whitespace between tokens here (the engine bounds runs; this checks the schema, not the layout)."""
    if kind == "choice":
        return any(choice.startswith(text) for choice in spec)
    import llguidance

    if kind == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(strict_schema(spec)))
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    else:
        raise ValueError(f"unknown constraint kind {kind!r}")
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error()

