"""Pieces both generation endpoints share: server state, sampling parameters, token limits, logprobs,
usage, merging several requests' streams, and racing a handler against the client's disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
from fastapi import Request, Response

from quire.core.engine.protocol import EngineClient
from quire.core.errors import ValidationError
from quire.core.lora.request import LoRARequest
from quire.core.outputs import PositionLogprobs, RequestOutput
from quire.core.renderer import Renderer
from quire.core.sampling_params import RequestOutputKind, SamplingParams
from quire.openai_server.errors import APIError
from quire.openai_server.lora import LoRAAdapters
from quire.openai_server.metrics import ServerMetrics
from quire.openai_server.protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from quire.openai_server.settings import ServerSettings
from quire.openai_server.structured_outputs import constraint_from_request

MAX_OPENAI_TEMPERATURE = 2.0
MAX_N = 128
RANK_HEADER = "X-data-parallel-rank"  # vLLM's: pins a request to one engine core of a data-parallel group


@dataclasses.dataclass
class ServerState:
    """Everything the routes share, held on ``app.state.server`` (no module globals)."""

    engine: EngineClient | None  # None while the model loads (the middleware answers 503 until then)
    settings: ServerSettings
    metrics: ServerMetrics
    draining: bool = False
    num_in_flight: int = 0
    lora: LoRAAdapters = dataclasses.field(default_factory=LoRAAdapters)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def served_model_names(self) -> list[str]:
        return self.settings.served_model_names

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def api_key_digests(self) -> list[bytes]:
        return [hashlib.sha256(key.encode()).digest() for key in self.settings.api_keys]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model, which an empty name also means); a 404
        for a name that is neither."""
        if not model or model in self.served_model_names:
            return None
        adapter = self.lora.get(model)
        if adapter is None:
            valid = [*self.served_model_names, *(a.lora_name for a in self.lora)]
            raise APIError(404, f"The model `{model}` does not exist. Valid models: {', '.join(valid)}.",
                           code="model_not_found", param="model")
        return adapter

    def check_task(self, *tasks: str) -> None:
        """A 400 naming ``model`` unless the engine serves one of ``tasks`` ("generate" for chat and completions,
        "embed" for embeddings, "embed" or "score" for score and rerank), checked before anything reaches the
        engine."""
        engine_task = self.engine.task
        if engine_task in tasks:
            return
        if engine_task == "generate":
            message = (f"the model `{self.model_name}` generates text and serves no embeddings; start the "
                       "server with --task embed on an embedding model")
        elif engine_task == "score":
            message = (f"the model `{self.model_name}` is a cross-encoder: it serves score and rerank requests "
                       "only")
        else:
            message = (f"the model `{self.model_name}` is an embedding model: it serves embedding, score and "
                       "rerank requests, not text generation")
        raise ValidationError(message, param="model", code="unsupported_value")

    def load_lora_modules(self) -> None:
        """The adapters of ``--lora-modules``, checked against the engine's model (at start-up)."""
        for name, path in self.settings.lora_modules:
            self.lora.load(name, path, self.engine.model_config, self.settings.max_lora_rank,
                           self.served_model_names)


def request_id(prefix: str, request: Request, body_request_id: str | None) -> str:
    base = body_request_id or request.scope.get("request_id") or uuid.uuid4().hex
    return f"{prefix}-{base}"


@contextlib.contextmanager
def pinned_engine(request: Request) -> Iterator[int | None]:
    """The engine core the request's ``X-data-parallel-rank`` header pins it to (None without the header),
    for ``add_request``; a rank that is not an integer, or that the engine refuses, is a 400 naming the
    header."""
    value = request.headers.get(RANK_HEADER)
    rank = None
    if value is not None:
        try:
            rank = int(value)
        except ValueError:
            raise ValidationError(f"{RANK_HEADER} must be an integer engine index, got {value!r}",
                                  param=RANK_HEADER) from None
    try:
        yield rank
    except ValidationError as error:
        if error.param != "data_parallel_rank":
            raise
        raise ValidationError(error.message.replace("data_parallel_rank", RANK_HEADER, 1), param=RANK_HEADER,
                              code=error.code) from None


def build_sampling_params(state: ServerState, body, *, max_tokens: int | None, logprobs: int | None,
                          prompt_logprobs: int | None, stream: bool) -> tuple[SamplingParams, str | None]:
    """The request's sampling fields, with unset ones taken from the model's generation config
    (``max_tokens=None``: the rest of the context, resolved by the engine's input processor), and the
    field its structured-output constraint came from (None without one), for naming it in errors."""
    defaults = state.engine.model_config.sampling_defaults
    temperature = body.temperature if body.temperature is not None else defaults.get("temperature", 1.0)
    if temperature is not None and temperature > MAX_OPENAI_TEMPERATURE:
        raise ValidationError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if body.n > MAX_N:
        raise ValidationError(f"n must be at most {MAX_N}, got {body.n}", param="n")
    if body.stream_options is not None and not stream:
        raise ValidationError("stream_options can only be set when stream is true", param="stream_options")
    constraint = constraint_from_request(body)
    return SamplingParams(
        n=body.n,
        temperature=temperature,
        top_p=_value(body.top_p, defaults, "top_p", 1.0),
        top_k=_value(body.top_k, defaults, "top_k", 0),
        min_p=_value(body.min_p, defaults, "min_p", 0.0),
        repetition_penalty=_value(body.repetition_penalty, defaults, "repetition_penalty", 1.0),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        bad_words=body.bad_words or [],
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        stream_interval=body.stream_interval,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=None if constraint is None else constraint.params,
    ), None if constraint is None else constraint.source


def _value(requested, defaults: dict, name: str, fallback):
    return requested if requested is not None else type(fallback)(defaults.get(name, fallback))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ValidationError("logit_bias keys must be token ids", param="logit_bias") from None


def usage(prompt_token_counts: list[int], outputs: list[RequestOutput]) -> Usage:
    prompt_tokens = sum(prompt_token_counts)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# -- logprobs ----------------------------------------------------------------------------------------

def _top(position: PositionLogprobs, k: int):
    return sorted(position.items(), key=lambda item: item[1].rank or 0)[:k]


def legacy_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], renderer: Renderer,
                    text_offset: int = 0) -> CompletionLogprobs:
    """Completions' shape; a None position (the first prompt token) gets null logprobs."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        if position is None:
            result.tokens.append(renderer.detokenize([token_id]))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            result.tokens.append(chosen.decoded_token or "")
            result.token_logprobs.append(chosen.logprob)
            # the chosen token and the top k (k + 1 entries when the chosen one is not among them)
            result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob
                                        for _, lp in sorted(position.items(), key=lambda i: i[1].rank or 0)})
        result.text_offset.append(text_offset)
        text_offset += len(result.tokens[-1])
    return result


def prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    if positions is None:
        return None
    return [None if position is None else
            {str(token): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for token, lp in position.items()} for position in positions]


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> ChoiceLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        content.append(TokenLogprob(
            token=chosen.decoded_token or "", logprob=chosen.logprob,
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode())) for _, lp in _top(position, k)],
        ))
    return ChoiceLogprobs(content=content)


# -- streams and disconnects -------------------------------------------------------------------------

async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' output streams as ``(stream index, output)``; closing the merged
    iterator (a client disconnect) cancels every stream, which aborts its request."""
    if len(streams) == 1:  # the usual case: no queue and no extra task per output
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream):
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, done))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable):
    """Run ``work`` unless the client disconnects first, in which case cancel it (which aborts the
    engine requests it was waiting on) and return None."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if not work_task.done():
        work_task.cancel()
        await asyncio.gather(work_task, return_exceptions=True)
        return None
    return work_task.result()


# The ``send`` the application received from the server (``QuireApp``), kept in the scope: streamed
# events go straight to it.
OUTER_SEND = "quire_outer_send"


class EventStream(Response):
    """A ``text/event-stream`` response from an async iterator of encoded events.

    The response start passes every middleware (which add headers and note that a response began);
    the events go to the ``send`` the application received from the server (``OUTER_SEND``): the
    middlewares in between pass body messages through untouched, and a streamed token would otherwise
    cross each.
    ``direct``: the response's output stream, when it has just one, with the function that turns one of its
    outputs into events (bytes, empty for none: the function ``events`` applies, on the same state). While
    ``events`` waits on the stream, the engine's output handler hands the stream's outputs to that function
    and the events are written there and then (``OutputStream.set_sink``): a streamed token wakes no task
    of the response's. The final output, and any output the function fails on, reach ``events`` as usual,
    in order. (With several streams a merging queue sits between them and ``events``, and outputs written
    directly could overtake queued ones.) A third item, when there, turns a plain step's new text and token ids
    into its events, or returns None to have the step built as an output and go the way above: the stream's
    text sink (``set_text_sink``) then takes those steps before any output object is made.
    A client that disconnects cancels the stream, whose generator then aborts its requests.
    """

    media_type = "text/event-stream"
    # (slots for what a streamed token reads: kept in the object rather than in its dict)
    __slots__ = ("events", "direct", "_writing", "_text_lane", "_encode_text", "_write_raw", "_loop", "_send_failed",
                 "_deferred")

    def __init__(self, events: AsyncIterator[bytes],
                 direct: tuple[Any, Callable[[RequestOutput], bytes]]
                 | tuple[Any, Callable[[RequestOutput], bytes], Callable[[str, list[int]], bytes | None]]
                 | None = None):
        self.events = events
        self.direct = direct
        self.status_code = 200
        self.background = None
        self.init_headers(None)
        self._writing: asyncio.Future | None = None  # a direct write held up by the server's back-pressure
        # while a text sink is set: (send, the pump), the text encoder, raw_chunk_writer's writer, the loop
        self._text_lane: tuple | None = None
        self._encode_text: Callable[[str, list[int]], bytes | None] | None = None
        self._write_raw: RawChunkWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_failed = False
        self._deferred: bytes | None = None  # the text lane's events held for the end of the step

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        send_event = scope.get(OUTER_SEND, send)
        # The events are written from a task of their own: a token's wake-up then resumes the few frames
        # of that task, not the ~20 of the route, middleware and server chain this coroutine runs under.
        loop = asyncio.get_running_loop()  # (once: on Python 3.11 each call costs a getpid() system call)
        pump = loop.create_task(self._pump(send_event))
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            pump.cancel()

        watcher = loop.create_task(watch())
        stream = None
        text_sink = False
        if self.direct is not None and hasattr(self.direct[0], "set_sink"):
            stream, encode = self.direct[:2]
            stream.set_sink(functools.partial(self._write_now, send_event, encode, pump))
            if len(self.direct) > 2 and hasattr(stream, "set_text_sink"):
                self._text_lane = (send_event, pump)
                self._encode_text, self._write_raw = self.direct[2], raw_chunk_writer(send_event)
                self._loop = loop
                text_sink = stream.set_text_sink(self._write_text)
        try:
            await pump  # cancelling this task cancels the pump too
        except asyncio.CancelledError:
            if not (gone or self._send_failed) or not pump.cancelled():
                raise
            # the client left: nothing more to send, nothing to report
        finally:
            if stream is not None:
                stream.set_sink(None)
                if text_sink:
                    stream.set_text_sink(None)
            watcher.cancel()
            if not pump.done():
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
            self._deferred = None  # a response cut short drops what it held
            if self._writing is not None and not self._writing.done():
                self._writing.cancel()

    def _write_now(self, send_event, encode, pump: asyncio.Future, output: RequestOutput) -> bool:
        """The sink: write ``output``'s event without waiting, or return False to leave it to the pump."""
        if self._deferred is not None:
            self._flush_deferred()
        writing = self._writing
        if writing is not None:
            if not writing.done() or writing.cancelled() or writing.exception() is not None:
                return False  # an earlier event waits for the client to read (keep the order), or failed
            self._writing = None
        if self._send_failed:
            return False
        try:
            body = encode(output)
        except Exception:  # noqa: BLE001 - left to the pump, whose generator meets it again and reports it
            return False
        if not body:
            return True  # nothing to write (no new text)
        return self._send_now(send_event, pump, body)

    def _write_text(self, text: str, token_ids: list[int]) -> bool:
        """The text sink: take a plain step's event, or return False to have it built as an output and go the
        usual way (``_write_now``, then the pump). The event is written when the output handler's step is done
        (``_flush_deferred_writes``), with every other response's: a step's writes then leave in one burst. A write
        wakes its client, which the kernel may run on this core, ahead of the rest of the step's work, if that
        still has to run (measured: 18x the involuntary context switches and ~10% more CPU a token)."""
        if self._writing is not None or self._send_failed:
            return False
        body = self._encode_text(text, token_ids)
        if body is None:
            return False
        if self._deferred is not None:
            self._deferred += body  # several steps before the loop came round: one write
            return True
        self._deferred = body
        loop = self._loop
        batch = _DEFERRED_WRITES.get(loop)
        if batch is None:
            batch = _DEFERRED_WRITES[loop] = []
            loop.call_soon(_flush_deferred_writes, loop, batch)
        batch.append(self)
        return True

    def _flush_deferred(self) -> None:
        """Write what ``_write_text`` holds: straight to the transport when ``raw_chunk_writer`` can, else by
        ``send``. Everything else that writes to this response calls this first, so the order holds."""
        body, self._deferred = self._deferred, None
        if body is None or self._send_failed:
            return
        if self._write_raw is None or not self._write_raw.write(body):
            self._send_now(*self._text_lane, body)

    def _send_now(self, send_event, pump: asyncio.Future, body: bytes) -> bool:
        sending = send_event({"type": "http.response.body", "body": body, "more_body": True})
        try:
            waiting_on = sending.send(None)
        except StopIteration:
            return True
        except Exception:  # noqa: BLE001 - the connection failed: end the response as if the client left
            self._send_failed = True
            pump.cancel()
            return True
        # the server holds the write until the client reads: finish it in a task of its own
        self._writing = asyncio.ensure_future(_resume(sending, waiting_on))
        return True

    async def _pump(self, send_event) -> None:
        try:
            async for event in self.events:
                if self._deferred is not None:
                    self._flush_deferred()
                if self._writing is not None:
                    await self._writing
                await send_event({"type": "http.response.body", "body": event, "more_body": True})
            if self._deferred is not None:
                self._flush_deferred()
            if self._writing is not None:
                await self._writing
            await send_event({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()


# Per event loop, the responses whose text-lane events wait for the end of the current step (an entry lives
# from the step's first held event to the callback that writes them, in the same turn of the loop).
_DEFERRED_WRITES: dict[asyncio.AbstractEventLoop, list[EventStream]] = {}


def _flush_deferred_writes(loop: asyncio.AbstractEventLoop, batch: list[EventStream]) -> None:
    if _DEFERRED_WRITES.get(loop) is batch:
        del _DEFERRED_WRITES[loop]
    for response in batch:
        if response._deferred is not None:  # (else something wrote it first)
            response._flush_deferred()


_HTTPTOOLS_CYCLE = ("transport", "flow", "disconnected", "response_started", "response_complete",
                    "chunked_encoding", "scope")


def raw_chunk_writer(send_event) -> RawChunkWriter | None:
    """uvicorn's httptools protocol writes each chunk of a streamed body as ``<size in hex>\r\n<chunk>\r\n`` on
    its transport, when the response is chunked, started and unfinished, the client connected and the
    transport not paused. The writer returned does exactly that for a response whose start was sent, without
    the coroutine, message and checks of ``send`` per chunk (several microseconds a streamed token), and
    returns False whenever one of those conditions fails: ``send`` then takes the chunk (it waits for a
    paused transport, drops writes to a gone client). None unless ``send_event`` is that protocol's ``send``
    on a chunked, started response to a request other than HEAD."""
    cycle = getattr(send_event, "__self__", None)
    if (type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl"
            or getattr(send_event, "__name__", None) != "send"
            or not all(hasattr(cycle, name) for name in _HTTPTOOLS_CYCLE)
            or not (cycle.response_started and cycle.chunked_encoding) or cycle.scope.get("method") == "HEAD"):
        return None
    return RawChunkWriter(cycle)


class RawChunkWriter:
    """``raw_chunk_writer``'s writer: ``write(chunk)`` writes a chunk, or returns False. One object
    holding what it reads (not a closure, whose cells are objects apart: each a cache line to fetch again
    after every write's trip through the kernel)."""

    __slots__ = ("transport", "flow", "cycle")

    def __init__(self, cycle):
        self.transport, self.flow, self.cycle = cycle.transport, cycle.flow, cycle

    def write(self, body: bytes) -> bool:
        cycle = self.cycle
        if self.flow.write_paused or cycle.disconnected or cycle.response_complete or not body:
            return False
        self.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return True


async def _resume(coroutine, waiting_on) -> None:
    """Run a coroutine that was started by hand (``coroutine.send(None)``) and is waiting on
    ``waiting_on`` (what it yielded: an asyncio future, or None to let others run) to its end, as a task
    would."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                waiting_on._asyncio_future_blocking = False  # taken, as a task takes what it is handed
                await waiting_on
        except BaseException as error:  # noqa: BLE001 - the coroutine gets it, as under a task
            try:
                waiting_on = coroutine.throw(error)
            except StopIteration:
                return
        else:
            try:
                waiting_on = coroutine.send(None)
            except StopIteration:
                return


_JSON = msgspec.json.Encoder()


SSE_DONE = b"data: [DONE]\n\n"


class ChunkWriter:
    """The events of one streamed response, ``{"id", "object", "created", "model", "choices"[, "usage"]}``:
    the fixed head is encoded once per stream, and a chunk whose one choice carries only new text (the
    usual streamed token) is written from fixed pieces around the encoded text."""

    def __init__(self, response_id: str, kind: str, created: int, model: str):
        self._head = b'data: {"id":%s,"object":%s,"created":%d,"model":%s,"choices":' % (
            _JSON.encode(response_id), _JSON.encode(kind), created, _JSON.encode(model))
        self._text_chunks: dict[int, tuple[bytes, bytes]] = {}
        self._kind = kind

    def chunk(self, choices: list[dict], usage: dict | None = None, exact_floats: bool = False) -> bytes:
        """Any chunk. msgspec writes JSON several times faster than ``json``; ``exact_floats`` (chunks with
        logprobs) goes through ``json``, which keeps -inf as ``-Infinity`` where msgspec would write null."""
        if exact_floats:
            payload = {"choices": choices} if usage is None else {"choices": choices, "usage": usage}
            body = json.dumps(payload, separators=(",", ":"))[len('{"choices":'):].encode()
            return self._head + body + b"\n\n"
        tail = b"}\n\n" if usage is None else b',"usage":' + _JSON.encode(usage) + b"}\n\n"
        return self._head + _JSON.encode(choices) + tail

    def text(self, index: int, text: str) -> bytes:
        """The chunk of a choice that carries new text and nothing else: a completion's
        ``{"index", "text", "logprobs": null, "finish_reason": null, "stop_reason": null}``, a chat
        completion's ``{"index", "delta": {"content"}, "logprobs": null, "finish_reason": null}``."""
        pieces = self.text_pieces(index)
        return pieces[0] + _JSON.encode(text) + pieces[1]

    def text_pieces(self, index: int) -> tuple[bytes, bytes]:
        """What goes before and after the JSON-encoded text in ``text``'s chunk."""
        pieces = self._text_chunks.get(index)
        if pieces is None:
            if self._kind == "text_completion":
                before, after = b'[{"index":%d,"text":' % index, b',"logprobs":null,"finish_reason":null,' \
                    b'"stop_reason":null}]}\n\n'
            else:
                before, after = b'[{"index":%d,"delta":{"content":' % index, b'},"logprobs":null,' \
                    b'"finish_reason":null}]}\n\n'
            pieces = self._text_chunks[index] = (self._head + before, after)
        return pieces
