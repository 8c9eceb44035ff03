"""Incremental detokenization and stop strings, per request, in the front end.

Text grows through ``tokenizers``' ``DecodeStream``, which withholds a token until its bytes form whole
characters, so a multi-byte character split over tokens is never emitted as U+FFFD mid-stream. Byte-level
BPE tokenizers (GPT-2's decoder, used by Llama 3, Qwen, SmolLM2 and the test checkpoints) decode by joining
each token's fixed bytes: for them a table of those bytes (``BytePieces``) and an incremental UTF-8 decoder,
which holds back an incomplete character the same way, give the same text for a fraction of the work.
"""

from __future__ import annotations

import codecs

from tokenizers.decoders import DecodeStream

from quire.core.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context.
_PROMPT_CONTEXT_TOKENS = 8


def _byte_level_alphabet() -> dict[str, int]:
    """The characters a byte-level BPE vocabulary spells bytes with: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(0x100 + extra)] = byte
            extra += 1
    return alphabet


def _text(piece: bytes) -> str | None:
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return None


class BytePieces:
    """Every token id's bytes under a byte-level decoder, as ``tokenizers`` decodes them: a token spelled in
    the byte alphabet gives those bytes, any other (an added token with a space, say) its UTF-8; special
    tokens give nothing when skipped. ``of`` builds it for a tokenizer, or returns None for any other decoder
    (or if a single-token decode disagrees with the table anywhere)."""

    def __init__(self, pieces: list[bytes], special_ids: frozenset[int]):
        self.pieces = pieces
        self.skipping = [b"" if i in special_ids else piece for i, piece in enumerate(pieces)]
        # each piece's text when its bytes are whole characters on their own (None where they are not)
        self.texts = [_text(piece) for piece in pieces]
        self.skipping_texts = ["" if i in special_ids else text for i, text in enumerate(self.texts)]

    @classmethod
    def of(cls, tokenizer) -> BytePieces | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        alphabet = _byte_level_alphabet()
        pieces = []
        for token_id in range(size):
            token = backend.id_to_token(token_id)
            if token is None:
                pieces.append(b"")
            elif all(c in alphabet for c in token):
                pieces.append(bytes(alphabet[c] for c in token))
            else:
                pieces.append(token.encode())
        # the table must say what the tokenizer says, token by token (a token whose bytes are not whole
        # characters decodes to U+FFFD on its own, which the lossy decode agrees with)
        decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        if any(text != piece.decode("utf-8", "replace") for text, piece in zip(decoded, pieces)):
            return None
        return cls(pieces, frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special))


class IncrementalDetokenizer:
    """Accumulates a request's output text; finds stop strings; withholds text that may become one.
    ``pieces``: the tokenizer's ``BytePieces`` when it has them (the output processor builds them once)."""

    # (slots: a streamed token reads and writes several of these; kept in the object, not a values array apart)
    __slots__ = ("_backend", "_skip_special_tokens", "_special_ids", "_previous_token", "_pieces", "_texts", "_utf8",
                 "_held", "_stream", "_stop", "_include_stop", "_min_tokens", "_stop_buffer", "token_ids",
                 "_text", "_tail", "_length", "_sent_text_offset", "simple")

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 pieces: BytePieces | None = None):
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        # Fast tokenizers ignore spaces_between_special_tokens; emulate False by dropping the space a
        # decoder puts between two consecutive special tokens.
        self._special_ids = (frozenset(tokenizer.all_special_ids)
                             if not (params.spaces_between_special_tokens or params.skip_special_tokens)
                             else frozenset())
        self._previous_token: int | None = None
        if pieces is not None:
            skip = params.skip_special_tokens
            self._pieces = pieces.skipping if skip else pieces.pieces
            self._texts = pieces.skipping_texts if skip else pieces.texts
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._held = False  # the UTF-8 decoder holds the start of a character
        else:
            self._pieces = None
            self._stream = DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
                                        skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._stop_buffer = 0 if self._include_stop or not self._stop else max(map(len, self._stop)) - 1
        self.token_ids: list[int] = []
        # The output text is ``_text`` followed by the pieces ``add_simple`` appended to ``_tail`` since it was last
        # read (``output_text`` joins them then): a streamed token does not copy the whole text into a new string.
        self._text, self._tail, self._length = "", [], 0
        self._sent_text_offset = 0
        # byte pieces, no stop strings, no special-token spacing to emulate: ``add_simple`` may be used
        self.simple = self._pieces is not None and not self._stop and not self._special_ids

    @property
    def output_text(self) -> str:
        if self._tail:
            self._text += "".join(self._tail)
            self._tail.clear()
        return self._text

    @output_text.setter
    def output_text(self, text: str) -> None:
        self._tail.clear()
        self._text, self._length = text, len(text)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens; return the stop string if one completed (later tokens are then dropped).

        ``stop_terminated``: the engine stopped on the last token (EOS or a stop token id), whose
        text is left out unless ``include_stop_str_in_output``.
        """
        pieces = self._pieces
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            is_stop_token = stop_terminated and i == len(new_token_ids) - 1
            if is_stop_token and not self._include_stop:
                break
            if pieces is None:
                piece = self._stream.step(self._backend, token_id)
            else:
                piece = self._decode_piece(token_id)
            if piece and token_id in self._special_ids and self._previous_token in self._special_ids:
                piece = piece.removeprefix(" ")
            self._previous_token = token_id
            if not piece:
                continue
            self.output_text += piece
            if self._stop and len(self.token_ids) >= self._min_tokens:
                stop = self._find_stop(len(piece))
                if stop is not None:
                    return stop
        return None

    def add_simple(self, token_id: int) -> str:
        """``update([token_id], False)`` then ``next_text(False, True)``, when ``simple``: the new text."""
        self.token_ids.append(token_id)
        texts = self._texts
        piece = texts[token_id] if not self._held and 0 <= token_id < len(texts) else None
        if piece is None:
            piece = self._decode_piece(token_id)
        self._previous_token = token_id
        sent, length = self._sent_text_offset, self._length
        if sent != length:  # text added before and not sent yet: it goes out with this piece
            text = self.output_text[sent:] + piece
        else:
            text = piece
        if piece:
            self._tail.append(piece)
            self._length = length = length + len(piece)
        self._sent_text_offset = length
        return text

    def _decode_piece(self, token_id: int) -> str:
        """A token's text from its bytes: the table's text while no character is split, else through the UTF-8
        decoder (which holds an incomplete character's bytes and writes U+FFFD for invalid ones)."""
        in_vocabulary = 0 <= token_id < len(self._pieces)
        if not self._held:
            text = self._texts[token_id] if in_vocabulary else ""
            if text is not None:
                return text
        text = self._utf8.decode(self._pieces[token_id] if in_vocabulary else b"")
        self._held = bool(self._utf8.buffer)
        return text

    def finish(self, stop_terminated: bool) -> None:
        """Flush bytes the stream still holds (an incomplete character at the very end)."""
        if self._pieces is not None:  # the UTF-8 decoder holds them: its end writes U+FFFD as the full decode does
            if self._held:
                self.output_text += self._utf8.decode(b"", True)
                self._held = False
            return
        ids = self.token_ids[:-1] if stop_terminated and not self._include_stop else self.token_ids
        full = self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        if len(full) > len(self.output_text) and full.startswith(self.output_text):
            self.output_text = full

    def next_text(self, finished: bool, delta: bool) -> str:
        """Text to emit now: all of it (cumulative) or the new part (delta), minus any withheld tail."""
        end = len(self.output_text) if finished else max(
            len(self.output_text) - self._stop_buffer, self._sent_text_offset)
        if not delta:
            return self.output_text[:end]
        text = self.output_text[self._sent_text_offset:end]
        self._sent_text_offset = end
        return text

    def _find_stop(self, num_new_chars: int) -> str | None:
        # Only the new characters (and the stop string's length before them) can complete a match;
        # the stop string that completes earliest wins.
        best, best_end = None, None
        for stop in self._stop:
            start = max(0, len(self.output_text) - num_new_chars - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1 and (best_end is None or index + len(stop) < best_end):
                best, best_end = stop, index + len(stop)
        if best is None:
            return None
        self.output_text = self.output_text[:best_end if self._include_stop else best_end - len(best)]
        return best
