"""``POST /v1/chat/completions``: messages rendered with the chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from quire.core.errors import ValidationError
from quire.core.renderer import ChatPrompt
from quire.openai_server.errors import stream_error_event
from quire.openai_server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    TokenizeRequest,
)
from quire.openai_server.serving import (
    SSE_DONE,
    ServerState,
    build_sampling_params,
    chat_logprobs,
    prompt_logprobs,
    request_id,
    sse,
    sse_json,
    until_disconnect,
    usage,
)
from quire.openai_server.structured_outputs import naming_errors

MAX_TOP_LOGPROBS = 20


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    state.check_model(body.model)
    _check_unsupported(body)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params, source = build_sampling_params(state, body, max_tokens=max_tokens, logprobs=num_logprobs,
                                           prompt_logprobs=body.prompt_logprobs, stream=body.stream)
    rid = request_id("chatcmpl", request, body.request_id)
    with naming_errors(source):
        stream = await state.engine.add_request(rid, chat_prompt(state, body), params, priority=body.priority,
                                                cache_salt=body.cache_salt, timeout=state.settings.request_timeout)
    num_prompt_tokens = len(stream.prompt_token_ids)
    if body.stream:
        return StreamingResponse(_stream(state, body, rid, stream, num_prompt_tokens), media_type="text/event-stream")
    output = await until_disconnect(request, _final(stream))
    if output is None:
        return None
    choices = [ChatChoice(
        index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        logprobs=chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0) if body.logprobs else None,
    ) for c in sorted(output.outputs, key=lambda c: c.index)]
    return ChatCompletionResponse(id=rid, model=state.model_name, choices=choices,
                                  usage=usage([num_prompt_tokens], [output]),
                                  prompt_logprobs=prompt_logprobs(output.prompt_logprobs))


def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> ChatPrompt:
    """The request's messages for the engine's renderer, with the server's chat template (if any)."""
    return ChatPrompt([m.model_dump(exclude_none=True) for m in body.messages], state.settings.chat_template,
                      body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
        raise ValidationError(f"max_completion_tokens must be at least 1, got {body.max_completion_tokens}",
                              param="max_completion_tokens")
    if body.tools:
        raise ValidationError("tools are not supported by this server", param="tools", code="unsupported_value")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise ValidationError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValidationError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}",
                                  param="top_logprobs")


async def _final(stream):
    final = None
    async for output in stream:
        final = output
    return final


async def _stream(state, body, rid, stream, num_prompt_tokens):
    created = int(time.time())
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    continuous = include_usage and body.stream_options.continuous_usage_stats
    started: set[int] = set()
    completion_tokens = 0

    def chunk(choices, usage_tokens=None, encode=sse):
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": state.model_name, "choices": choices}
        if usage_tokens is not None:
            payload["usage"] = {"prompt_tokens": num_prompt_tokens, "completion_tokens": usage_tokens,
                                "total_tokens": num_prompt_tokens + usage_tokens}
        return encode(payload)

    try:
        async for output in stream:
            for completion in output.outputs:
                if completion.index not in started:
                    started.add(completion.index)
                    yield chunk([{"index": completion.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}],
                                completion_tokens if continuous else None)
                completion_tokens += len(completion.token_ids)
                if not completion.text and not completion.token_ids and completion.finish_reason is None:
                    continue
                choice = {"index": completion.index,
                          "delta": {"content": completion.text} if completion.text else {},
                          "logprobs": None, "finish_reason": completion.finish_reason}
                if completion.stop_reason is not None:
                    choice["stop_reason"] = completion.stop_reason
                encode = sse
                if body.logprobs and completion.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs,
                                                       body.top_logprobs or 0).model_dump()
                    encode = sse_json
                yield chunk([choice], completion_tokens if continuous else None, encode)
        if include_usage:
            yield chunk([], completion_tokens)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the stream has started: report it in the stream
        yield stream_error_event(error)
    finally:
        await stream.aclose()  # a client gone mid-stream: closing the stream aborts its request
    yield SSE_DONE
