"""Incremental detokenization and stop strings, per request, in the front end.

Text grows through ``tokenizers``' ``DecodeStream``, which withholds a token until its bytes form whole
characters, so a multi-byte character split over tokens is never emitted as U+FFFD mid-stream.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from quire.core.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context.
_PROMPT_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    """Accumulates a request's output text; finds stop strings; withholds text that may become one."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        # Fast tokenizers ignore spaces_between_special_tokens; emulate False by dropping the space a
        # decoder puts between two consecutive special tokens.
        self._special_ids = (frozenset(tokenizer.all_special_ids)
                             if not (params.spaces_between_special_tokens or params.skip_special_tokens)
                             else frozenset())
        self._previous_token: int | None = None
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
                                    skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._stop_buffer = 0 if self._include_stop or not self._stop else max(map(len, self._stop)) - 1
        self.token_ids: list[int] = []
        self.output_text = ""
        self._sent_text_offset = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens; return the stop string if one completed (later tokens are then dropped).

        ``stop_terminated``: the engine stopped on the last token (EOS or a stop token id), whose
        text is left out unless ``include_stop_str_in_output``.
        """
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            is_stop_token = stop_terminated and i == len(new_token_ids) - 1
            if is_stop_token and not self._include_stop:
                break
            piece = self._stream.step(self._backend, token_id)
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

    def finish(self, stop_terminated: bool) -> None:
        """Flush bytes the stream still holds (an incomplete character at the very end)."""
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
