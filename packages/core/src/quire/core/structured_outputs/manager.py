"""The engine core's side of structured outputs: compiling constraints off the busy loop, caching compiled
grammars, each request's grammar state, and the step's token bitmask.

A request with a constraint is given a ``StructuredOutputRequest`` when it arrives. Its grammar compiles on
a worker thread (or comes from the cache at once); the scheduler leaves the request waiting, without
holding up the others, until ``is_ready``. Each step, ``grammar_bitmask`` fills one preallocated int32
row per constrained request that samples, which the sampler's ``GrammarBitmask`` processor applies before
any sampling parameter. Sampled tokens advance the grammar (``accept``); a request whose grammar has
terminated is finished. A grammar that fell out of step with its request's tokens (a token it refused) is
rebuilt from the request's output tokens.

Reasoning models: a request that carries the token ids of its reasoning parser's tags (the front end adds
them when a reasoning parser is configured) is not constrained, and its tokens are not fed to the grammar,
until its reasoning is over: the end tag is in its output, or its prompt already closed the thinking (the
end tag after the last start tag, as a template that turns thinking off writes it). This module imports
no torch; the backends do, on the worker thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from quire.core.structured_outputs.backends import (
    CompiledGrammar,
    Grammar,
    StructuredOutputBackend,
    bitmask_words,
    get_backend_class,
)

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
_DEFAULT_BACKEND = "xgrammar"


class StructuredOutputRequest:
    """One request's constraint: its compile future, then its grammar."""

    def __init__(self, key: tuple, future: concurrent.futures.Future, reasoning_ended: bool = True,
                 reasoning_end_token_ids: tuple[int, ...] = ()):
        self.key = key
        self.future = future
        self.grammar: Grammar | None = None
        self.error: str | None = None
        self.num_accepted = 0  # output tokens fed to the grammar (after the reasoning, if any)
        self.reasoning_ended = reasoning_ended
        self.reasoning_offset = 0  # output tokens before the constraint started (the reasoning)
        self.reasoning_end_token_ids = reasoning_end_token_ids
        self._reasoning_checked = 0  # output tokens already searched for the end tag

    def is_ready(self) -> bool:
        """The grammar compiled (or failed: then ``error`` says why); never blocks."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.grammar = self.future.result().new_grammar()
        except Exception as error:  # noqa: BLE001 - a constraint that fails to compile fails its request only
            self.error = f"the structured-output constraint failed to compile: {error}"
        return True

    def reasoning_ends_in(self, output_token_ids: list[int]) -> bool:
        """Whether the end tag has appeared in the output (only the tokens new since the last call are
        searched, with the tag's length of overlap)."""
        end_ids = self.reasoning_end_token_ids
        start = max(0, self._reasoning_checked - len(end_ids) + 1)
        self._reasoning_checked = len(output_token_ids)
        return bool(end_ids) and _find_last(output_token_ids[start:], end_ids) >= 0

    @property
    def is_active(self) -> bool:
        """The constraint applies to the next token (compiled, and any reasoning is over)."""
        return self.grammar is not None and self.reasoning_ended

    def accept(self, token_id: int) -> bool:
        """Feed one sampled token to the grammar; False if the grammar refuses it. A no-op while inactive."""
        if not self.is_active:
            return True
        self.num_accepted += 1
        return self.grammar.accept_tokens([token_id])

    def is_terminated(self) -> bool:
        return self.is_active and self.grammar.is_terminated()


class StructuredOutputManager:
    """Compiles, caches and steps the grammars of one engine core's requests."""

    def __init__(self, tokenizer_path: str, vocab_size: int, max_num_seqs: int, num_speculative_tokens: int = 0):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids: list[int] | None = None  # the grammars' stop tokens: the requests' EOS ids
        import numpy as np

        # a row per sampled position: with speculation, each proposal and the token after them
        num_rows = max_num_seqs * (1 + num_speculative_tokens)
        self.bitmask = np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()  # the backends and the tokenizer, built on the compile thread
        self._compile_seconds: list[float] = []  # compiles finished since the last take_compile_seconds
        self.num_compiled = 0

    # -- requests in ---------------------------------------------------------------------------

    def add_request(self, params, eos_token_ids: Sequence[int], prompt_token_ids: Sequence[int] = (),
                    reasoning_tags: tuple[Sequence[int], Sequence[int]] | None = None) -> StructuredOutputRequest:
        """Start compiling (or reuse) the grammar of a request's ``StructuredOutputsParams``.

        ``eos_token_ids`` (the same for every request of an engine: the front end's) end a grammar.
        ``reasoning_tags``: the token ids of the reasoning parser's start and end tags, when the constraint
        must wait for the reasoning to end."""
        if self.eos_token_ids is None:
            self.eos_token_ids = list(eos_token_ids)
        key = (params.backend or _DEFAULT_BACKEND, params.kind, params.spec, params.disable_any_whitespace)
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
        else:
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        if reasoning_tags is None:
            return StructuredOutputRequest(key, future)
        start_ids, end_ids = tuple(reasoning_tags[0]), tuple(reasoning_tags[1])
        closed = _closed_in_prompt(list(prompt_token_ids), start_ids, end_ids)
        return StructuredOutputRequest(key, future, reasoning_ended=closed, reasoning_end_token_ids=end_ids)

    def _compile(self, key: tuple) -> CompiledGrammar:
        backend_name, kind, spec, compact = key
        backend = self._backend(backend_name)  # loaded once (the tokenizer's vocabulary): not compile time
        start = time.perf_counter()
        compiled = backend.compile(kind, spec, compact)
        seconds = time.perf_counter() - start
        with self._lock:
            self._compile_seconds.append(seconds)
            self.num_compiled += 1
        logger.debug("compiled a %s constraint with %s in %.1f ms", kind, backend_name, seconds * 1e3)
        return compiled

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                if self._tokenizer is None:
                    from quire.core.tokenizer import load_tokenizer

                    self._tokenizer = load_tokenizer(self.tokenizer_path)
                start = time.perf_counter()
                backend = get_backend_class(name)(self._tokenizer, self.vocab_size, self.eos_token_ids)
                self._backends[name] = backend
                logger.info("structured outputs: %s backend ready in %.2f s", name, time.perf_counter() - start)
            return backend

    def wait_for_any(self, requests, timeout: float) -> None:
        """Block up to ``timeout`` seconds until one of these requests' grammars is compiled."""
        futures = [r.structured_output.future for r in requests]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def take_compile_seconds(self) -> list[float]:
        with self._lock:
            seconds, self._compile_seconds = self._compile_seconds, []
        return seconds

    # -- one step --------------------------------------------------------------------------------

    def grammar_bitmask(self, requests, spec_tokens: dict[str, list[int]] | None = None
                        ) -> tuple[list[str], Any] | None:
        """Fill a bitmask row for each of these (sampling, constrained) requests whose constraint is on;
        return the request ids in row order and the filled rows (a view of the preallocated array).

        A request verifying proposals (``spec_tokens``) gets a row per position, in order: the tokens
        allowed after its output so far, then after each proposal in turn (its id repeats); the grammar is
        walked over the proposals and rolled back."""
        request_ids = []
        spec_tokens = spec_tokens or {}
        for request in requests:
            structured = request.structured_output
            if not self._constraint_on(request, structured):
                continue
            self._sync(request, structured)
            grammar = structured.grammar
            grammar.fill_bitmask(self.bitmask, len(request_ids))
            request_ids.append(request.request_id)
            proposal = spec_tokens.get(request.request_id, ())
            for token_id in proposal:
                if not grammar.accept_tokens([token_id]):  # proposals are checked when made: not expected
                    raise RuntimeError(f"request {request.request_id}: proposed token {token_id} is not allowed")
                if grammar.is_terminated():  # the request ends at this token: what follows is dropped
                    self.bitmask[len(request_ids)] = -1
                else:
                    grammar.fill_bitmask(self.bitmask, len(request_ids))
                request_ids.append(request.request_id)
            if proposal:
                grammar.rollback(len(proposal))
        if not request_ids:
            return None
        return request_ids, self.bitmask[:len(request_ids)]

    def valid_proposal(self, request, proposal: list[int]) -> list[int]:
        """The longest start of ``proposal`` that the request's active constraint allows."""
        structured = request.structured_output
        self._sync(request, structured)
        return proposal[:structured.grammar.count_valid(proposal)]

    def _constraint_on(self, request, structured: StructuredOutputRequest) -> bool:
        if structured.grammar is None:
            return False
        if not structured.reasoning_ended:
            if not structured.reasoning_ends_in(request.output_token_ids):
                return False
            structured.reasoning_ended = True
            structured.reasoning_offset = request.num_output_tokens
            structured.num_accepted = 0
        return True

    @staticmethod
    def _sync(request, structured: StructuredOutputRequest) -> None:
        """Rebuild a grammar that has not seen exactly the request's output tokens (after a refused token)."""
        expected = request.num_output_tokens - structured.reasoning_offset
        if structured.num_accepted != expected:
            structured.grammar.reset()
            structured.grammar.accept_tokens(request.output_token_ids[structured.reasoning_offset:])
            structured.num_accepted = expected

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _find_last(token_ids: list[int], pattern: tuple[int, ...]) -> int:
    """Index of the last occurrence of ``pattern`` in ``token_ids`` (-1: none)."""
    size = len(pattern)
    for start in range(len(token_ids) - size, -1, -1):
        if tuple(token_ids[start:start + size]) == pattern:
            return start
    return -1


def _closed_in_prompt(prompt: list[int], start_ids: tuple[int, ...], end_ids: tuple[int, ...]) -> bool:
    """The prompt opened the thinking and closed it again (a template with thinking turned off)."""
    start = _find_last(prompt, start_ids) if start_ids else -1
    return start >= 0 and _find_last(prompt[start:], end_ids) >= 0
