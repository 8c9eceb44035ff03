"""Incremental detokenization against a full decode, over multi-byte and combining characters."""

import pytest

from quire.core.engine.detokenizer import BytePieces, IncrementalDetokenizer
from quire.core.sampling_params import SamplingParams

TEXT = "Café, 中文 and 😀 — e\u0301tude (e + combining acute) ok 😀😀"
PROMPT = "print('hello')\n"


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    ids = tiny_tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT) // 2, "expected multi-byte characters to span several tokens"
    return ids


@pytest.fixture(params=["decode_stream", "byte_pieces"])
def pieces(request, tiny_tokenizer):
    """Each test runs over ``tokenizers``' DecodeStream (None) and over the byte-level table (``BytePieces``)."""
    if request.param == "decode_stream":
        return None
    table = BytePieces.of(tiny_tokenizer)
    assert table is not None
    return table


def make(tokenizer, pieces, **params):
    return IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams(**params), pieces)


def test_token_by_token_text_is_always_the_decoded_prefix_without_partial_characters(tiny_tokenizer, ids, pieces):
    detok = make(tiny_tokenizer, pieces)
    streamed = ""
    for k, token_id in enumerate(ids, start=1):
        detok.update([token_id], stop_terminated=False)
        delta = detok.next_text(finished=False, delta=True)
        assert "\ufffd" not in delta
        streamed += delta
        assert streamed == tiny_tokenizer.decode(ids[:k]).rstrip("\ufffd")
    assert streamed == TEXT == tiny_tokenizer.decode(ids)


def test_two_chunks_split_at_every_point_equal_the_full_decode(tiny_tokenizer, ids, pieces):
    for split in range(1, len(ids)):
        detok = make(tiny_tokenizer, pieces)
        detok.update(ids[:split], stop_terminated=False)
        first = detok.next_text(finished=False, delta=True)
        detok.update(ids[split:], stop_terminated=False)
        detok.finish(stop_terminated=False)
        second = detok.next_text(finished=True, delta=True)
        assert "\ufffd" not in first + second, f"split at {split}"
        assert first + second == tiny_tokenizer.decode(ids), f"split at {split}"


def test_a_sequence_cut_mid_character_ends_like_the_full_decode(tiny_tokenizer, ids, pieces):
    cut = next(k for k in range(1, len(ids)) if tiny_tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = make(tiny_tokenizer, pieces)
    detok.update(ids[:cut], stop_terminated=False)
    assert "\ufffd" not in detok.next_text(finished=False, delta=False)
    detok.finish(stop_terminated=False)
    assert detok.next_text(finished=True, delta=False) == tiny_tokenizer.decode(ids[:cut])


def test_partial_stop_strings_are_withheld_until_resolved(tiny_tokenizer, pieces):
    ids = tiny_tokenizer.encode("abc STOP here")
    detok = make(tiny_tokenizer, pieces, stop=["STOP!"])
    streamed = ""
    for token_id in ids:
        assert detok.update([token_id], stop_terminated=False) is None
        streamed += detok.next_text(finished=False, delta=True)
        assert not streamed.endswith(("S", "ST", "STO", "STOP"))
    detok.finish(stop_terminated=False)
    streamed += detok.next_text(finished=True, delta=True)
    assert streamed == "abc STOP here"


def test_stop_string_truncates_text_and_drops_later_tokens(tiny_tokenizer, pieces):
    ids = tiny_tokenizer.encode("one two three four")
    detok = make(tiny_tokenizer, pieces, stop=["three", "two t"])
    assert detok.update(ids, stop_terminated=False) == "two t"  # completes before "three"
    assert detok.output_text == "one "
    assert tiny_tokenizer.decode(detok.token_ids).find("two t") != -1
    assert len(detok.token_ids) < len(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_byte_table_gives_the_decode_streams_text_for_any_ids(tiny_tokenizer, skip_special_tokens):
    """Random ids (split and invalid UTF-8, special tokens, ids past the vocabulary) and real text: the table's
    text, token by token through ``add_simple``, ends equal to the DecodeStream's through ``update``."""
    import random

    pieces = BytePieces.of(tiny_tokenizer)
    size = len(pieces.pieces)
    rng = random.Random(0)
    cases = [tiny_tokenizer.encode(TEXT)] + [[rng.randrange(size + 3) for _ in range(rng.randrange(1, 40))]
                                            for _ in range(150)]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for ids in cases:
        table, stream = (IncrementalDetokenizer(tiny_tokenizer, [5], params, pieces),
                         IncrementalDetokenizer(tiny_tokenizer, [5], params))
        assert table.simple and not stream.simple
        texts = ["", ""]
        for token_id in ids:
            texts[0] += table.add_simple(token_id)
            stream.update([token_id], stop_terminated=False)
            texts[1] += stream.next_text(finished=False, delta=True)
        for index, detok in enumerate((table, stream)):
            detok.finish(stop_terminated=False)
            texts[index] += detok.next_text(finished=True, delta=True)
        assert texts[0] == texts[1], ids
        assert texts[0] == tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_byte_pieces_only_for_byte_level_decoders():
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    assert BytePieces.of(SimpleNamespace(backend_tokenizer=backend)) is None
    assert BytePieces.of(None) is None
