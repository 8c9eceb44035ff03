"""``POST /v1/completions``: text or token-id prompts (one or several), streamed or not."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from quire.core.engine.protocol import EngineClient, OutputStream
from quire.core.errors import ValidationError
from quire.core.outputs import RequestOutput
from quire.core.renderer import PromptType
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
        return EventStream(_stream(state, body, base_id, streams, prompt_texts, counts))
    outputs = await until_disconnect(request, _collect(streams))
    if outputs is None:
        return None  # the client is gone
    return _response(state, body, base_id, outputs, prompt_texts, counts)


def _prompts(body: CompletionRequest) -> list[PromptType]:
    """The request's prompts in the engine's prompt forms (rendering and checks happen there)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
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


async def _stream(state, body, base_id, streams, prompt_texts, counts):
    writer = ChunkWriter(base_id, "text_completion", int(time.time()), state.model_name)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    continuous = include_usage and body.stream_options.continuous_usage_stats
    with_logprobs = body.logprobs is not None
    echoed: set[int] = set()
    completion_tokens = 0
    # One prompt (the usual case) is read straight from its stream: no merging generator in between,
    # which every streamed token would otherwise pass through.
    several = len(streams) > 1
    source = merge_streams(streams) if several else streams[0]
    try:
        async for item in source:
            prompt_index, output = item if several else (0, item)
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                text = completion.text
                if body.echo and index not in echoed:
                    echoed.add(index)
                    text = prompt_texts[prompt_index] + text
                completion_tokens += len(completion.token_ids)
                if completion.finish_reason is None and not (continuous or with_logprobs):
                    if text or completion.token_ids:
                        yield writer.text(index, text)
                    continue
                if not text and not completion.token_ids and completion.finish_reason is None:
                    continue
                choice = {"index": index, "text": text, "logprobs": None,
                          "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
                exact_floats = with_logprobs and completion.logprobs is not None
                if exact_floats:
                    choice["logprobs"] = legacy_logprobs(completion.token_ids, completion.logprobs,
                                                         state.engine.renderer).model_dump()
                yield writer.chunk([choice], _usage_dict(sum(counts), completion_tokens) if continuous else None,
                                   exact_floats)
        if include_usage:
            yield writer.chunk([], _usage_dict(sum(counts), completion_tokens))
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the stream has started: report it in the stream
        yield stream_error_event(error)
    finally:
        await source.aclose()  # a client gone mid-stream: closing the stream aborts its request
    yield SSE_DONE


def _usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
