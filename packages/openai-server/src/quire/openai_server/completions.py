"""``POST /v1/completions``: text or token-id prompts (one or several), streamed or not."""

from __future__ import annotations

import asyncio
import functools
import time

import msgspec
from fastapi import Request

from quire.core.engine.protocol import EngineClient, OutputStream
from quire.core.errors import ValidationError
from quire.core.outputs import RequestOutput
from quire.core.renderer import PromptType, is_token_ids
from quire.openai_server.errors import stream_error_event
from quire.openai_server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from quire.openai_server.serving import (
    SSE_DONE,
    ChunkWriter,
    EventStream,
    ServerState,
    build_sampling_params,
    legacy_logprobs,
    merge_streams,
    pinned_engine,
    prompt_logprobs,
    request_id,
    until_disconnect,
    usage,
)
from quire.openai_server.structured_outputs import naming_errors

_encode_json = msgspec.json.Encoder().encode


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    adapter = state.check_model(body.model)
    if body.suffix is not None:
        raise ValidationError("suffix is not supported by this model", param="suffix", code="unsupported_value")
    if body.best_of not in (None, body.n):
        raise ValidationError("best_of is not supported (set it to n or leave it out)", param="best_of",
                              code="unsupported_value")
    if body.echo and body.stream and body.logprobs is not None:
        raise ValidationError("echo with logprobs is not available when streaming", param="echo",
                              code="unsupported_value")
    engine = state.engine
    base_id = request_id("cmpl", request, body.request_id)
    params, source = build_sampling_params(
        state, body, max_tokens=body.max_tokens, logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else body.prompt_logprobs,
        stream=body.stream)
    streams = []
    try:
        with naming_errors(source), pinned_engine(request) as rank:
            for index, prompt in enumerate(_prompts(body)):
                streams.append(await engine.add_request(f"{base_id}-{index}", prompt, params,
                                                        priority=body.priority, cache_salt=body.cache_salt,
                                                        timeout=state.settings.request_timeout,
                                                        data_parallel_rank=rank, lora_request=adapter))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    prompt_texts = [_prompt_text(engine, stream) for stream in streams] if body.echo else [""] * len(streams)
    counts = [len(stream.prompt_token_ids) for stream in streams]
    if body.stream:
        events = _CompletionEvents(state, body, base_id, prompt_texts, counts)
        direct = (streams[0], functools.partial(events.of, 0), events.text_of) if len(streams) == 1 else None
        return EventStream(_stream(events, streams), direct)
    outputs = await until_disconnect(request, _collect(streams))
    if outputs is None:
        return None  # the client is gone
    return _response(state, body, base_id, outputs, prompt_texts, counts)


def _prompts(body: CompletionRequest) -> list[PromptType]:
    """The request's prompts in the engine's prompt forms (rendering and checks happen there)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and is_token_ids(prompt)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise ValidationError("prompt must not be empty", param="prompt")
    return [{"prompt": item, "add_special_tokens": body.add_special_tokens} if isinstance(item, str) else item
            for item in items]


def _prompt_text(engine: EngineClient, stream: OutputStream) -> str:
    """What ``echo`` repeats: the prompt's text, or its token ids decoded."""
    return stream.prompt if stream.prompt is not None else engine.renderer.detokenize(stream.prompt_token_ids)


async def _collect(streams) -> list[RequestOutput]:
    finals = [None] * len(streams)
    async for index, output in merge_streams(streams):
        finals[index] = output
    return finals


def _choice_text(body: CompletionRequest, prompt_text: str, text: str, first: bool) -> str:
    return prompt_text + text if body.echo and first else text


def _response(state, body, base_id, outputs, prompt_texts, counts) -> CompletionResponse:
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            logprobs = None
            if body.logprobs is not None:
                ids, positions = list(completion.token_ids), list(completion.logprobs or [])
                if body.echo:
                    ids = list(output.prompt_token_ids) + ids
                    positions = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + positions
                logprobs = legacy_logprobs(ids, positions, state.engine.renderer)
            choices.append(CompletionChoice(
                index=prompt_index * body.n + completion.index,
                text=_choice_text(body, prompt_texts[prompt_index], completion.text, True),
                logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs(output.prompt_logprobs) if body.prompt_logprobs is not None else None,
            ))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=base_id, model=state.model_name, choices=choices, usage=usage(counts, outputs))


class _CompletionEvents:
    """The server-sent events of one streamed completion response, computed output by output and
    synchronously: the response's pump and its direct writes (``EventStream``) share this state."""

    __slots__ = ("writer", "renderer", "body", "prompt_texts", "num_prompt_tokens", "include_usage", "continuous",
                 "with_logprobs", "echoed", "completion_tokens", "plain", "_text_before", "_text_after")

    def __init__(self, state: ServerState, body: CompletionRequest, base_id: str, prompt_texts: list[str],
                 counts: list[int]):
        self.writer = ChunkWriter(base_id, "text_completion", int(time.time()), state.model_name)
        self.renderer = state.engine.renderer
        self.body = body
        self.prompt_texts = prompt_texts
        self.num_prompt_tokens = sum(counts)
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage
        self.continuous = self.include_usage and body.stream_options.continuous_usage_stats
        self.with_logprobs = body.logprobs is not None
        self.echoed: set[int] = set()
        self.completion_tokens = 0
        # a streamed token is the usual text chunk (``text_of``) unless the chunks carry more than text
        self.plain = not (self.continuous or self.with_logprobs or body.echo)
        self._text_before, self._text_after = self.writer.text_pieces(0)  # (text_of's, computed once)

    def text_of(self, text: str, token_ids: list[int]) -> bytes | None:
        """The event of an unfinished step of a one-prompt request's only completion that carries no more than
        new text and token ids, as ``of`` writes it; None when the chunks carry more (``of`` then)."""
        if not self.plain:
            return None
        self.completion_tokens += len(token_ids)
        return self._text_before + _encode_json(text) + self._text_after

    def of(self, prompt_index: int, output: RequestOutput) -> bytes:
        """The events of one output of prompt ``prompt_index`` (empty when it carries nothing to send)."""
        body, writer = self.body, self.writer
        events = b""
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            text = completion.text
            if body.echo and index not in self.echoed:
                self.echoed.add(index)
                text = self.prompt_texts[prompt_index] + text
            self.completion_tokens += len(completion.token_ids)
            if completion.finish_reason is None and not (self.continuous or self.with_logprobs):
                if text or completion.token_ids:
                    events += writer.text(index, text)  # the usual streamed token
                continue
            if not text and not completion.token_ids and completion.finish_reason is None:
                continue
            choice = {"index": index, "text": text, "logprobs": None,
                      "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
            exact_floats = self.with_logprobs and completion.logprobs is not None
            if exact_floats:
                choice["logprobs"] = legacy_logprobs(completion.token_ids, completion.logprobs,
                                                     self.renderer).model_dump()
            events += writer.chunk([choice], self._usage() if self.continuous else None, exact_floats)
        return events

    def end(self) -> bytes:
        """The usage event, when the request asked for it."""
        return self.writer.chunk([], self._usage()) if self.include_usage else b""

    def _usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.num_prompt_tokens + self.completion_tokens}


async def _stream(events: _CompletionEvents, streams):
    # One prompt (the usual case) is read straight from its stream: no merging generator in between,
    # which every streamed token would otherwise pass through.
    several = len(streams) > 1
    source = merge_streams(streams) if several else streams[0]
    tail = b""  # the only stream's final events, written with the usage event and [DONE]: one write, not three
    try:
        async for item in source:
            prompt_index, output = item if several else (0, item)
            data = events.of(prompt_index, output)
            if output.finished and not several:  # (a stream ends with its finished output)
                tail += data
            elif data:
                yield data
        tail += events.end()
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the stream has started: report it in the stream
        tail += stream_error_event(error)
    finally:
        await source.aclose()  # a client gone mid-stream: closing the stream aborts its request
    yield tail + SSE_DONE
