"""Chat messages to prompt token ids, with the checkpoint's chat template or an override."""

from __future__ import annotations

from typing import Any

from quire.core.errors import ValidationError

Conversation = list[dict[str, Any]]


def render_chat(
    tokenizer,
    messages: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render ``messages`` with the template (``chat_template.jinja`` or ``tokenizer_config.json``,
    both read by the tokenizer; ``chat_template`` overrides them) and tokenize the result."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template; pass one with chat_template",
                              param="chat_template")
    normalized = [_normalize_message(i, message) for i, message in enumerate(messages)]
    if not normalized:
        raise ValidationError("messages must not be empty", param="messages")
    text = tokenizer.apply_chat_template(
        normalized, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
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
