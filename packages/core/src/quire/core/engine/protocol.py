"""``EngineClient``: the one seam every front end (offline ``LLM``, server, CLI) depends on."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from quire.core.config import ModelConfig


@runtime_checkable
class EngineClient(Protocol):
    """What every engine client offers, whether its engine core runs in-process or in its own process.

    Requests go in and come back in the style of the concrete client: ``LLMEngine`` (synchronous:
    ``add_request``, then ``step()`` until done, ``abort_request``) or ``AsyncLLM`` (asyncio:
    ``async for output in generate(...)``, ``await abort(...)``). Both validate and tokenize on the way
    in, raising ``ValidationError`` that names the bad field, and detokenize on the way out.

    ``max_model_len`` is the limit the engine core reported once it was ready. ``check_health()``
    raises ``EngineDeadError`` once the engine core can no longer serve; ``errored`` says the same
    without raising.
    """

    model_config: ModelConfig
    max_model_len: int

    @property
    def errored(self) -> bool: ...

    @property
    def is_running(self) -> bool: ...

    def check_health(self) -> None: ...

    def get_tokenizer(self): ...

    def render_chat(self, messages, chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> list[int]: ...

    def get_metrics(self): ...

    def shutdown(self) -> None: ...
