"""Prompts as callers give them, and the ``Renderer``: the one place that renders chat messages with a
template and turns text into token ids (and token ids back into text) for every front door.

Prompt forms (as vLLM's): text, a list of token ids, ``{"prompt": text}`` (optionally with
``"add_special_tokens"``), ``{"prompt_token_ids": [...]}``, or a ``ChatPrompt`` of messages. This module
imports neither torch nor transformers; the tokenizer is handed in.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jinja2

from quire.core.errors import ValidationError

Conversation = list[dict[str, Any]]
# Inputs this long (characters) are rendered off the event loop by asyncio front ends.
LONG_PROMPT_CHARS = 4096
_RESERVED_TEMPLATE_ARGUMENTS = {"conversation", "messages", "chat_template", "tokenize", "tools",
                                "documents", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "tokenizer_kwargs"}


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """Messages to render with the chat template (``chat_template`` overrides the checkpoint's).

    ``add_generation_prompt`` None means "open an assistant turn unless ``continue_final_message``",
    which leaves the last (assistant) message open for the model to continue; both true is an error.
    ``chat_template_kwargs`` are extra variables for the template. ``tools`` (OpenAI's function tool
    definitions) go to the template's ``tools`` variable, as Hugging Face templates expect them; assistant
    messages may carry ``tool_calls`` (their JSON ``arguments`` are handed to the template as objects) and
    ``role: "tool"`` messages answer them (``tool_call_id``).
    """

    messages: Conversation
    chat_template: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


PromptType = str | list[int] | dict[str, Any] | ChatPrompt


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as token ids. ``text`` is the text they came from (the rendered template for chats; None
    for token-id prompts); ``is_chat`` makes length errors name ``messages`` instead of ``prompt``."""

    token_ids: list[int]
    text: str | None
    is_chat: bool = False

    @property
    def param(self) -> str:
        return "messages" if self.is_chat else "prompt"


class Renderer:
    """Renders and tokenizes with one checkpoint's tokenizer; ``vocab_size`` is the model's (the bound
    every token id is checked against)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def render(self, prompt: PromptType) -> RenderedPrompt:
        """Any prompt form as token ids, raising ``ValidationError`` (naming the field) for bad input."""
        if isinstance(prompt, ChatPrompt):
            return self.render_chat(prompt)
        add_special_tokens = True
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                add_special_tokens = prompt.get("add_special_tokens", True)
                prompt = prompt["prompt"]
            else:
                raise ValidationError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValidationError("prompt must not be empty", param="prompt")
            return RenderedPrompt(self.tokenize(prompt, add_special_tokens), prompt)
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            self.check_token_ids(token_ids, "prompt")
            return RenderedPrompt(token_ids, None)
        raise ValidationError("prompt must be a string or a list of token ids", param="prompt")

    def render_chat(self, chat: ChatPrompt) -> RenderedPrompt:
        """Render ``chat.messages`` with the template (``chat_template.jinja`` or
        ``tokenizer_config.json``, both read by the tokenizer, unless the prompt carries its own) and
        tokenize the result."""
        tokenizer = self.tokenizer
        if chat.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValidationError("this model has no chat template; pass one with chat_template",
                                  param="chat_template")
        normalized = [_normalize_message(i, message) for i, message in enumerate(chat.messages)]
        if not normalized:
            raise ValidationError("messages must not be empty", param="messages")
        reserved = set(chat.chat_template_kwargs or ()) & _RESERVED_TEMPLATE_ARGUMENTS
        if reserved:
            raise ValidationError(f"chat_template_kwargs may not set {sorted(reserved)}",
                                  param="chat_template_kwargs")
        add_generation_prompt = _generation_prompt(chat, normalized)
        try:
            text = tokenizer.apply_chat_template(
                normalized, chat_template=chat.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=chat.continue_final_message, tools=chat.tools,
                **(chat.chat_template_kwargs or {}),
            )
        except jinja2.TemplateError as error:
            raise ValidationError(f"the chat template could not render these messages: {error}",
                                  param="messages") from None
        # The template already contains any special tokens the model expects.
        return RenderedPrompt(self.tokenize(text, add_special_tokens=False), text, is_chat=True)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int], param: str = "tokens") -> str:
        self.check_token_ids(token_ids, param)
        return self.tokenizer.decode(token_ids)

    def check_token_ids(self, token_ids, param: str) -> None:
        """Raise ``ValidationError`` naming ``param`` if any id is outside the model's vocabulary."""
        vocab_size = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} in {param} is out of vocabulary (0..{vocab_size - 1})",
                                  param=param)


def is_long(prompt: PromptType) -> bool:
    """Whether rendering ``prompt`` may take long enough to be moved off an event loop."""
    if isinstance(prompt, ChatPrompt):
        return sum(len(str(m.get("content") or "")) for m in prompt.messages if isinstance(m, dict)) > LONG_PROMPT_CHARS
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt", "")
    return isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS


def _generation_prompt(chat: ChatPrompt, messages: Conversation) -> bool:
    if chat.continue_final_message:
        if chat.add_generation_prompt:
            raise ValidationError("continue_final_message and add_generation_prompt cannot both be true",
                                  param="continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise ValidationError("continue_final_message needs a final assistant message",
                                  param="continue_final_message")
        return False
    return True if chat.add_generation_prompt is None else chat.add_generation_prompt


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValidationError(f"{param} must be an object with role and content", param=param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValidationError(f"{param}.role must be a non-empty string", param=f"{param}.role")
    content = message.get("content", "")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValidationError(f"{param}.content parts must be text parts",
                                      param=f"{param}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ValidationError(f"{param}.content must be a string or a list of text parts",
                              param=f"{param}.content")
    normalized = {**message, "content": content}
    if message.get("tool_calls"):
        normalized["tool_calls"] = [_template_tool_call(f"{param}.tool_calls[{i}]", call)
                                    for i, call in enumerate(message["tool_calls"])]
    return normalized


def _template_tool_call(param: str, call: Any) -> dict[str, Any]:
    """A tool call as chat templates read it: ``function.arguments`` as an object, not JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError(f"{param} must be an object with function.name", param=param)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ValidationError(f"{param}.function.arguments is not valid JSON",
                                  param=f"{param}.function.arguments") from None
    return {**call, "function": {**function, "arguments": arguments}}
