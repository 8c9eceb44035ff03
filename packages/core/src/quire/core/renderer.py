"""Prompts as callers give them, and the ``Renderer``: the one place that renders chat messages with a
template and turns text into token ids (and token ids back into text) for every front door.

Prompt forms (as vLLM's): text, a list of token ids, ``{"prompt": text}`` (optionally with
``"add_special_tokens"`` and, for vision-language models, ``"multi_modal_data": {"image": ...}``),
``{"prompt_token_ids": [...]}``, or a ``ChatPrompt`` of messages (whose content parts may be images). This
module imports neither torch nor transformers nor an image library; the tokenizer, and for models that take
images the ``quire.core.multimodal`` processor, are handed in.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jinja2

from quire.core.errors import ValidationError
from quire.core.multimodal.parts import ImageInput, image_from_part, images_from_multi_modal_data, is_image_part

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
    for token-id prompts); ``is_chat`` makes length errors name ``messages`` instead of ``prompt``.
    ``mm_features`` (``wire.MultiModalFeature``, in prompt order) are the prompt's processed images."""

    token_ids: list[int]
    text: str | None
    is_chat: bool = False
    mm_features: list | None = None

    @property
    def param(self) -> str:
        return "messages" if self.is_chat else "prompt"


class Renderer:
    """Renders and tokenizes with one checkpoint's tokenizer; ``vocab_size`` is the model's (the bound
    every token id is checked against). ``multimodal`` is the model's ``MultiModalProcessor`` (None: the
    model takes text only, and images are refused)."""

    def __init__(self, tokenizer, vocab_size: int, multimodal=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.multimodal = multimodal

    def render(self, prompt: PromptType) -> RenderedPrompt:
        """Any prompt form as token ids, raising ``ValidationError`` (naming the field) for bad input."""
        if isinstance(prompt, ChatPrompt):
            return self.render_chat(prompt)
        add_special_tokens = True
        images: list[ImageInput] = []
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:
                images = self._images_of(images_from_multi_modal_data(prompt["multi_modal_data"]))
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
            if images:
                token_ids, features = self.multimodal.process(prompt, images, add_special_tokens, "prompt")
                return RenderedPrompt(token_ids, prompt, mm_features=features)
            return RenderedPrompt(self._text_token_ids(prompt, add_special_tokens, "prompt"), prompt)
        if isinstance(prompt, (list, tuple)) and is_token_ids(prompt):
            if images:
                raise ValidationError("multi_modal_data needs a text prompt (with the model's image placeholders), "
                                      "not token ids", param="multi_modal_data")
            token_ids = list(prompt)
            self.check_token_ids(token_ids, "prompt")
            self._check_no_placeholders(token_ids, "prompt")
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
        images: list[ImageInput] | None = [] if self.multimodal is not None else None
        normalized = [_normalize_message(i, message, images) for i, message in enumerate(chat.messages)]
        if images:
            self.multimodal.check_count(images, "messages")  # before rendering or loading anything
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
        if images:
            token_ids, features = self.multimodal.process(text, images, False, "messages")
            return RenderedPrompt(token_ids, text, is_chat=True, mm_features=features)
        return RenderedPrompt(self._text_token_ids(text, False, "messages"), text, is_chat=True)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int], param: str = "tokens") -> str:
        self.check_token_ids(token_ids, param)
        return self.tokenizer.decode(token_ids)

    def _images_of(self, images: list[ImageInput]) -> list[ImageInput]:
        """A prompt dict's images, refused for a text-only model or beyond the limit (before any is loaded)."""
        if not images:
            return images
        if self.multimodal is None:
            raise ValidationError("this model takes text only; it cannot read images", param=images[0].param)
        self.multimodal.check_count(images, "multi_modal_data")
        return images

    def _text_token_ids(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            token_ids = self.tokenize(text, add_special_tokens)
        except (TypeError, UnicodeEncodeError):
            if _is_text(text):
                raise
            raise ValidationError(f"{param} is not valid Unicode text: it holds an unpaired surrogate (such as "
                                  "a lone \\ud800 escape in JSON)", param=param) from None
        self._check_no_placeholders(token_ids, param)
        return token_ids

    def _check_no_placeholders(self, token_ids: list[int], param: str) -> None:
        """A prompt without images may not hold image placeholder tokens (the model would read garbage there)."""
        if self.multimodal is not None and self.multimodal.image_token_id in token_ids:
            raise ValidationError(f"{param} holds the model's image placeholder token but no image", param=param)

    def check_token_ids(self, token_ids, param: str) -> None:
        """Raise ``ValidationError`` naming ``param`` if any id is outside the model's vocabulary."""
        vocab_size = self.vocab_size
        if isinstance(token_ids, (list, tuple, dict)) and (not token_ids or (
                min(token_ids) >= 0 and max(token_ids) < vocab_size)):
            return  # (the usual case: two passes in C instead of a generator over every id)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} in {param} is out of vocabulary (0..{vocab_size - 1})",
                                  param=param)


def is_token_ids(items: list | tuple) -> bool:
    """Whether a list or tuple holds integers only (bools are not token ids). The usual all-``int`` case is
    told by the set of the items' types, built in C: a 128-token prompt costs no Python per token."""
    return set(map(type, items)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def is_long(prompt: PromptType) -> bool:
    """Whether rendering ``prompt`` may take long enough to be moved off an event loop (long text; any
    image, which is decoded, maybe downloaded, and processed)."""
    if isinstance(prompt, ChatPrompt):
        num_chars = 0
        for message in prompt.messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                if any(is_image_part(part) for part in content):
                    return True
                num_chars += sum(len(str(part.get("text") or "")) for part in content if isinstance(part, dict))
            else:
                num_chars += len(str(content or ""))
        return num_chars > LONG_PROMPT_CHARS
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data"):
            return True
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


def _normalize_message(index: int, message: Any, images: list[ImageInput] | None) -> dict[str, Any]:
    """The message as the template reads it. ``images`` is None for a model that takes text only (list
    content is joined into one text; image parts are refused); otherwise list content stays a list of
    ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts, and the images are appended to it."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValidationError(f"{param} must be an object with role and content", param=param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValidationError(f"{param}.role must be a non-empty string", param=f"{param}.role")
    content = message.get("content", "")
    if isinstance(content, list):
        content = _content_parts(f"{param}.content", content, images)
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


def _content_parts(param: str, content: list, images: list[ImageInput] | None) -> str | list[dict[str, Any]]:
    parts = []
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if is_image_part(part):
            if images is None:
                raise ValidationError("this model takes text only; it cannot read images", param=part_param)
            images.append(image_from_part(part, part_param))
            parts.append({"type": "image"})
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kinds = "text parts" if images is None else "text or image (image_url, image_pil) parts"
            raise ValidationError(f"{param} parts must be {kinds}", param=part_param)
    if images is None:
        return "\n".join(part["text"] for part in parts)
    return parts


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


def _is_text(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (no unpaired surrogates), as a tokenizer needs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
