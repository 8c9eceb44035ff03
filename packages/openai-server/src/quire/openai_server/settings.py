"""The server's own options (the engine's are ``quire.core.EngineArgs``)."""

from __future__ import annotations

import dataclasses

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the HTTP side behaves. ``served_model_names[0]`` is the name used in responses and metrics."""

    served_model_names: list[str]
    host: str = "0.0.0.0"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    chat_template: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout: float = 0.0  # seconds in-flight requests may finish after SIGTERM
    request_timeout: float | None = None  # seconds a request may take in all (None: no limit)
    log_level: str = "info"
    enable_debug_routes: bool = False
    version: str = "0.1.0"
    tool_call_parser: str | None = None  # the engine option, read by the chat route
    reasoning_parser: str | None = None
    # LoRA (the engine's max_lora_rank, read by the adapter routes): adapters served from the start as
    # (name, folder), and whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_runtime_updates: bool = False
