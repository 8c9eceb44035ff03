"""Both grammar backends on quire-demo's tokenizer: what they let through and what they refuse, token by
token, against independent oracles (``json``, ``re``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quire.core.demo import demo_model_path
from quire.core.sampling_params import StructuredOutputsParams
from quire.core.structured_outputs.backends import MAX_JSON_WHITESPACE, bitmask_words, get_backend_class
from quire.core.tokenizer import load_tokenizer

EOS = [0, 2]
VOCAB = 4096


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(demo_model_path()))


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend(request, tokenizer):
    return get_backend_class(request.param)(tokenizer, VOCAB, EOS)


def walk(backend, tokenizer, params: StructuredOutputsParams, text: str) -> tuple[bool, list[int]]:
    """Feed ``text`` token by token, checking each token against the mask first; return whether the grammar
    allowed all of it, and the tokens it allows after."""
    backend.validate(params.kind, params.spec, params.disable_any_whitespace)
    grammar = backend.compile(params.kind, params.spec, params.disable_any_whitespace).new_grammar()
    bitmask = np.zeros((2, bitmask_words(VOCAB)), dtype=np.int32)
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.fill_bitmask(bitmask, 1)
        if not (int(bitmask[1, token // 32]) >> (token % 32)) & 1 or not grammar.accept_tokens([token]):
            return False, []
    if grammar.is_terminated():
        return True, []
    grammar.fill_bitmask(bitmask, 1)
    return True, [t for t in range(VOCAB) if (int(bitmask[1, t // 32]) >> (t % 32)) & 1]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"]}


@pytest.mark.parametrize("text,allowed", [
    ('{"name": "abc", "n": 5}', True),
    ('{"name":"abc","n":99}', True),
    ('{"name": "abcdefghi", "n": 5}', False),  # longer than maxLength
    ('{"name": "abc", "n": 100}', False),  # above maximum
    ('{"name": "a\x1cb", "n": 1}', False),  # a raw control character is not JSON
    ('{"n": 1, "name": "a"}', False),  # property order is the schema's
    ('{"name": "abc", "n": 5, "x": 1}', "guidance"),  # only JSON Schema's default allows what is not named
    ('{"name": "abc",' + " " * (MAX_JSON_WHITESPACE + 1) + '"n": 5}', False),  # a whitespace run over the cap
])
def test_json_schema(backend, tokenizer, text, allowed):
    ok, after = walk(backend, tokenizer, StructuredOutputsParams(json=SCHEMA), text)
    if isinstance(allowed, str):  # xgrammar's strict mode (OpenAI's) vs llguidance's JSON Schema semantics
        allowed = backend.name == allowed
    assert ok == allowed
    if ok:
        assert set(after) <= set(EOS)  # complete: only the end of the text may follow
        assert json.loads(text)


def test_choices_with_quotes_and_unicode(backend, tokenizer):
    choices = ['say "hi"', "naïve", "a|b"]
    params = StructuredOutputsParams(choice=choices)
    for choice in choices:
        ok, after = walk(backend, tokenizer, params, choice)
        assert ok and set(after) <= set(EOS)
    assert not walk(backend, tokenizer, params, "say")[1] == []  # a prefix is not the end
    assert walk(backend, tokenizer, params, "nope")[0] is False


def test_regex_and_grammar(backend, tokenizer):
    params = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
    assert walk(backend, tokenizer, params, "123-ab")[0]
    assert not walk(backend, tokenizer, params, "12-ab")[0]
    grammar = StructuredOutputsParams(grammar='root ::= "yes" | "no" " thanks"?')
    assert walk(backend, tokenizer, grammar, "no thanks")[0]
    assert not walk(backend, tokenizer, grammar, "maybe")[0]


def test_count_valid_checks_proposals_without_moving_the_grammar(backend, tokenizer):
    """Speculative proposals: how many the grammar takes next, from the first; then it is where it was."""
    params = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
    grammar = backend.compile(params.kind, params.spec, params.disable_any_whitespace).new_grammar()
    tokens = [tokenizer.convert_tokens_to_ids(c) for c in "12-a"]
    assert grammar.count_valid(tokens) == 2  # "1", "2", then "-" comes too early
    assert grammar.count_valid([tokens[0], tokens[0], tokens[0], tokens[2], tokens[3], tokens[3]]) == 6
    assert grammar.accept_tokens(tokens[:2])  # the checks left the grammar at its start
    assert grammar.count_valid([tokens[0], tokens[2]]) == 2
    assert grammar.count_valid([tokens[2]]) == 0
    grammar.rollback(2)
    assert grammar.count_valid(tokens) == 2
