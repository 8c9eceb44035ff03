"""Chat messages to prompt token ids, with the checkpoint's chat template or an override."""

from __future__ import annotations

from typing import Any

import jinja2

from quire.core.errors import ValidationError

Conversation = list[dict[str, Any]]
_RESERVED_TEMPLATE_ARGUMENTS = {"conversation", "messages", "chat_template", "tokenize", "tools",
                                "documents", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "tokenizer_kwargs"}


def render_chat(
    tokenizer,
    messages: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render ``messages`` with the template (``chat_template.jinja`` or ``tokenizer_config.json``,
    both read by the tokenizer; ``chat_template`` overrides them) and tokenize the result.

    ``continue_final_message`` leaves the last (assistant) message open for the model to continue;
    ``chat_template_kwargs`` are extra variables for the template.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template; pass one with chat_template",
                              param="chat_template")
    normalized = [_normalize_message(i, message) for i, message in enumerate(messages)]
    if not normalized:
        raise ValidationError("messages must not be empty", param="messages")
    reserved = set(chat_template_kwargs or ()) & _RESERVED_TEMPLATE_ARGUMENTS
    if reserved:
        raise ValidationError(f"chat_template_kwargs may not set {sorted(reserved)}",
                              param="chat_template_kwargs")
    if continue_final_message and add_generation_prompt:
        raise ValidationError("continue_final_message and add_generation_prompt cannot both be true",
                              param="continue_final_message")
    if continue_final_message and normalized[-1]["role"] != "assistant":
        raise ValidationError("continue_final_message needs a final assistant message",
                              param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            normalized, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
    except jinja2.TemplateError as error:
        raise ValidationError(f"the chat template could not render these messages: {error}",
                              param="messages") from None
    # The template already contains any special tokens the model expects.
    return tokenizer.encode(text, add_special_tokens=False)


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
    return {**message, "content": content}
