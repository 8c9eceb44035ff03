"""``POST /v1/completions``: text or token-id prompts (one or several), streamed or not."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from quire.core.errors import ValidationError
from quire.core.outputs import RequestOutput
from quire.openai_server.errors import stream_error_event
from quire.openai_server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from quire.openai_server.serving import (
    SSE_DONE,
    ServerState,
    build_sampling_params,
    legacy_logprobs,
    merge_streams,
    prompt_logprobs,
    request_id,
    resolve_max_tokens,
    sse,
    sse_json,
    until_disconnect,
    usage,
)

LONG_PROMPT_CHARS = 4096


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    if body.suffix is not None:
        raise ValidationError("suffix is not supported by this model", param="suffix", code="unsupported_value")
    if body.best_of not in (None, body.n):
        raise ValidationError("best_of is not supported (set it to n or leave it out)", param="best_of",
                              code="unsupported_value")
    if body.echo and body.stream and body.logprobs is not None:
        raise ValidationError("echo with logprobs is not available when streaming", param="echo",
                              code="unsupported_value")
    engine = state.engine
    prompts = await _prompts(engine, body)
    base_id = request_id("cmpl", request, body.request_id)
    streams, prompt_texts = [], []
    try:
        for index, (text, token_ids) in enumerate(prompts):
            max_tokens = resolve_max_tokens(body.max_tokens, len(token_ids), engine.max_model_len)
            params = build_sampling_params(
                state, body, max_tokens=max_tokens, logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else body.prompt_logprobs,
                stream=body.stream)
            sub_id = f"{base_id}-{index}"
            collector = await engine.add_request(sub_id, token_ids, params, priority=body.priority,
                                                 cache_salt=body.cache_salt,
                                                 timeout=state.settings.request_timeout)
            streams.append(engine.stream(sub_id, collector))
            prompt_texts.append(text)
    except BaseException:
        await engine.abort([f"{base_id}-{i}" for i in range(len(streams))])
        raise
    counts = [len(ids) for _, ids in prompts]
    if body.stream:
        return StreamingResponse(_stream(state, body, base_id, streams, prompt_texts, counts),
                                 media_type="text/event-stream")
    outputs = await until_disconnect(request, _collect(streams))
    if outputs is None:
        return None  # the client is gone
    return _response(state, body, base_id, outputs, prompt_texts, counts)


async def _prompts(engine, body: CompletionRequest) -> list[tuple[str, list[int]]]:
    """``(text, token ids)`` per prompt; text prompts are tokenized here (long ones off the event loop)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise ValidationError("prompt must not be empty", param="prompt")
    tokenizer = engine.get_tokenizer()
    result = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValidationError("prompt must not be empty", param="prompt")
            encode = lambda text=item: tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
            ids = await asyncio.to_thread(encode) if len(item) > LONG_PROMPT_CHARS else encode()
            result.append((item, ids))
        else:
            if not item:
                raise ValidationError("prompt must not be empty", param="prompt")
            vocab = engine.model_config.vocab_size
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValidationError(f"token id {bad} is out of vocabulary (0..{vocab - 1})", param="prompt")
            result.append((tokenizer.decode(item), list(item)))
    keep = body.truncate_prompt_tokens
    if keep is not None:
        keep = engine.max_model_len - 1 if keep == -1 else keep
        result = [(text, ids[-keep:] if keep > 0 else ids) for text, ids in result]
    return result


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
                logprobs = legacy_logprobs(ids, positions, state.engine.get_tokenizer())
            choices.append(CompletionChoice(
                index=prompt_index * body.n + completion.index,
                text=_choice_text(body, prompt_texts[prompt_index], completion.text, True),
                logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs(output.prompt_logprobs) if body.prompt_logprobs is not None else None,
            ))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=base_id, model=state.model_name, choices=choices, usage=usage(counts, outputs))


async def _stream(state, body, base_id, streams, prompt_texts, counts):
    created = int(time.time())
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    continuous = include_usage and body.stream_options.continuous_usage_stats
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
                if not text and not completion.token_ids and completion.finish_reason is None:
                    continue
                choice = {"index": index, "text": text, "logprobs": None,
                          "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
                encode = sse
                if body.logprobs is not None and completion.logprobs is not None:
                    choice["logprobs"] = legacy_logprobs(completion.token_ids, completion.logprobs,
                                                         state.engine.get_tokenizer()).model_dump()
                    encode = sse_json
                chunk = {"id": base_id, "object": "text_completion", "created": created,
                         "model": state.model_name, "choices": [choice]}
                if continuous:
                    chunk["usage"] = _usage_dict(sum(counts), completion_tokens)
                yield encode(chunk)
        if include_usage:
            yield sse({"id": base_id, "object": "text_completion", "created": created, "model": state.model_name,
                       "choices": [], "usage": _usage_dict(sum(counts), completion_tokens)})
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
