"""``POST /v1/chat/completions``: messages rendered with the chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time

import msgspec
from fastapi import Request

from quire.core.errors import ValidationError
from quire.core.outputs import RequestOutput
from quire.core.parsers.output import OutputParser, ParsedDelta
from quire.core.parsers.reasoning import get_reasoning_parser_class
from quire.core.parsers.tool_calls import get_tool_parser_class
from quire.core.parsers.tool_choice import ToolRequest, tool_request
from quire.core.renderer import ChatPrompt
from quire.openai_server.errors import stream_error_event
from quire.openai_server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    FunctionCall,
    TokenizeRequest,
    ToolCallOut,
)
from quire.openai_server.serving import (
    SSE_DONE,
    ChunkWriter,
    EventStream,
    ServerState,
    build_sampling_params,
    chat_logprobs,
    pinned_engine,
    prompt_logprobs,
    request_id,
    until_disconnect,
    usage,
)
from quire.openai_server.structured_outputs import naming_errors

MAX_TOP_LOGPROBS = 20

_encode_json = msgspec.json.Encoder().encode


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    adapter = state.check_model(body.model)
    _check_unsupported(body)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params, source = build_sampling_params(state, body, max_tokens=max_tokens, logprobs=num_logprobs,
                                           prompt_logprobs=body.prompt_logprobs, stream=body.stream)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    settings = state.settings
    tools = tool_request(messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                         auto_available=settings.tool_call_parser is not None)
    params, source = _with_tool_constraint(params, source, tools, settings)
    rid = request_id("chatcmpl", request, body.request_id)
    with naming_errors(source), pinned_engine(request) as rank:
        stream = await state.engine.add_request(rid, chat_prompt(state, body, tools), params,
                                                priority=body.priority, cache_salt=body.cache_salt,
                                                timeout=settings.request_timeout, data_parallel_rank=rank,
                                                lora_request=adapter)
    num_prompt_tokens = len(stream.prompt_token_ids)
    parsers = OutputParsers(settings, tools)
    if body.stream:
        events = _ChatEvents(state, body, rid, num_prompt_tokens, parsers)
        return EventStream(_stream(events, stream), (stream, events.of, events.text_of))
    output = await until_disconnect(request, _final(stream))
    if output is None:
        return None
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        message, finish_reason = AssistantMessage(content=c.text), c.finish_reason
        if parsers.enabled:
            parsed = parsers.new().parse(c.text)
            message = AssistantMessage(content=parsed.content, reasoning=parsed.reasoning,
                                       reasoning_content=parsed.reasoning,
                                       tool_calls=[ToolCallOut(id=call.id, function=FunctionCall(
                                           name=call.name, arguments=call.arguments))
                                                   for call in parsed.tool_calls] or None)
            finish_reason = _finish_reason(finish_reason, bool(parsed.tool_calls))
        choices.append(ChatChoice(
            index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0) if body.logprobs else None))
    return ChatCompletionResponse(id=rid, model=state.model_name, choices=choices,
                                  usage=usage([num_prompt_tokens], [output]),
                                  prompt_logprobs=prompt_logprobs(output.prompt_logprobs))


def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                tools: ToolRequest | None = None) -> ChatPrompt:
    """The request's messages for the engine's renderer, with the server's chat template (if any) and the
    request's tools."""
    return ChatPrompt([m.model_dump(exclude_none=True) for m in body.messages], state.settings.chat_template,
                      body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                      tools=None if tools is None else tools.tools)


class OutputParsers:
    """Makes each completion's ``OutputParser`` (reasoning, then tool calls); ``enabled`` is False when the
    server has no reasoning parser and the request no tool calls to read (the text goes out as is)."""

    def __init__(self, settings, tools: ToolRequest | None):
        self.settings = settings
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.enabled = settings.reasoning_parser is not None or self.tools is not None

    def new(self) -> OutputParser:
        settings, tools = self.settings, self.tools
        reasoning = (get_reasoning_parser_class(settings.reasoning_parser)()
                     if settings.reasoning_parser is not None else None)
        if tools is None:
            return OutputParser(reasoning)
        tool_parser = get_tool_parser_class(settings.tool_call_parser)() if tools.choice == "auto" else None
        return OutputParser(reasoning, tool_parser, named_tool=tools.named, required=tools.choice == "required")


def _with_tool_constraint(params, source, tools: ToolRequest | None, settings):
    """A named or required tool choice constrains the output (and cannot be combined with another
    constraint); an auto choice whose parser reads special tokens keeps them in the text."""
    if tools is None:
        return params, source
    constraint = tools.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ValidationError(f"tool_choice {tools.choice} constrains the output already; it cannot be "
                                  f"combined with {source}", param="tool_choice")
        return msgspec.structs.replace(params, structured_outputs=constraint), "tool_choice"
    if tools.choice == "auto" and get_tool_parser_class(settings.tool_call_parser).needs_special_tokens:
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    return params, source


def _finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """``tool_calls`` when a completion that stopped by itself made calls (OpenAI's reason)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
        raise ValidationError(f"max_completion_tokens must be at least 1, got {body.max_completion_tokens}",
                              param="max_completion_tokens")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise ValidationError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValidationError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}",
                                  param="top_logprobs")


def _delta_message(parser: OutputParser, text: str, finished: bool) -> dict:
    """The ``delta`` of one streamed chunk: content, reasoning and tool-call pieces (only what is there)."""
    parsed = parser.feed(text) if text else ParsedDelta()
    if finished:
        last = parser.finish()
        parsed.content += last.content
        parsed.reasoning += last.reasoning
        parsed.tool_calls += last.tool_calls
    delta: dict = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.reasoning:
        delta["reasoning"] = delta["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        delta["tool_calls"] = [_tool_call_delta(piece) for piece in parsed.tool_calls]
    return delta


def _tool_call_delta(piece) -> dict:
    function: dict = {"arguments": piece.arguments}
    entry: dict = {"index": piece.index}
    if piece.id is not None:
        entry["id"], entry["type"] = piece.id, "function"
        function["name"] = piece.name
    entry["function"] = function
    return entry


async def _final(stream):
    final = None
    async for output in stream:
        final = output
    return final


class _ChatEvents:
    """The server-sent events of one streamed chat completion, computed output by output and synchronously:
    the response's pump and its direct writes (``EventStream``) share this state."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, rid: str, num_prompt_tokens: int,
                 parsers: OutputParsers):
        self.body = body
        self.parsers = parsers
        self.num_prompt_tokens = num_prompt_tokens
        self.writer = ChunkWriter(rid, "chat.completion.chunk", int(time.time()), state.model_name)
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage
        self.continuous = self.include_usage and body.stream_options.continuous_usage_stats
        self.output_parsers: dict[int, OutputParser] = {}
        self.called: set[int] = set()
        self.started: set[int] = set()
        self.completion_tokens = 0
        # a streamed token is the usual content chunk (``text_of``) unless parsers or the chunks want more
        self.plain = not (parsers.enabled or self.continuous or body.logprobs)
        self._text_before, self._text_after = self.writer.text_pieces(0)  # (text_of's, computed once)

    def text_of(self, text: str, token_ids: list[int]) -> bytes | None:
        """The event of an unfinished step of the only completion that carries no more than new text and token
        ids, as ``of`` writes it; None when ``of`` is needed (the first chunk, no text, chunks that carry more)."""
        if not (self.plain and text and 0 in self.started):
            return None
        self.completion_tokens += len(token_ids)
        return self._text_before + _encode_json(text) + self._text_after

    def _chunk(self, choices, usage_tokens=None, exact_floats=False) -> bytes:
        usage = None if usage_tokens is None else {
            "prompt_tokens": self.num_prompt_tokens, "completion_tokens": usage_tokens,
            "total_tokens": self.num_prompt_tokens + usage_tokens}
        return self.writer.chunk(choices, usage, exact_floats)

    def of(self, output: RequestOutput) -> bytes:
        """The events of one output (empty when it carries nothing to send)."""
        body, parsers, continuous = self.body, self.parsers, self.continuous
        events = b""
        for completion in output.outputs:
            if completion.index not in self.started:
                self.started.add(completion.index)
                events += self._chunk([{"index": completion.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                                      self.completion_tokens if continuous else None)
            self.completion_tokens += len(completion.token_ids)
            if not completion.text and not completion.token_ids and completion.finish_reason is None:
                continue
            finish_reason = completion.finish_reason
            if parsers.enabled:
                parser = self.output_parsers.get(completion.index) or self.output_parsers.setdefault(
                    completion.index, parsers.new())
                delta = _delta_message(parser, completion.text, finish_reason is not None)
                if delta.get("tool_calls"):
                    self.called.add(completion.index)
                if not delta and finish_reason is None and not (body.logprobs and completion.logprobs):
                    continue
                finish_reason = _finish_reason(finish_reason, completion.index in self.called)
            elif (finish_reason is None and completion.stop_reason is None and completion.text
                  and not continuous and not (body.logprobs and completion.logprobs is not None)):
                events += self.writer.text(completion.index, completion.text)  # the usual streamed token
                continue
            else:
                delta = {"content": completion.text} if completion.text else {}
            choice = {"index": completion.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if completion.stop_reason is not None:
                choice["stop_reason"] = completion.stop_reason
            exact_floats = bool(body.logprobs) and completion.logprobs is not None
            if exact_floats:
                choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs,
                                                   body.top_logprobs or 0).model_dump()
            events += self._chunk([choice], self.completion_tokens if continuous else None, exact_floats)
        return events

    def end(self) -> bytes:
        """The usage event, when the request asked for it."""
        return self._chunk([], self.completion_tokens) if self.include_usage else b""


async def _stream(events: _ChatEvents, stream):
    tail = b""  # the final output's events, written with the usage event and [DONE]: one write, not three
    try:
        async for output in stream:
            data = events.of(output)
            if output.finished:  # (a stream ends with its finished output)
                tail += data
            elif data:
                yield data
        tail += events.end()
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the stream has started: report it in the stream
        tail += stream_error_event(error)
    finally:
        await stream.aclose()  # a client gone mid-stream: closing the stream aborts its request
    yield tail + SSE_DONE
