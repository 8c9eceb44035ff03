"""Which adapter a request runs with (no torch here: the front end and the scheduler read it)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter, in vLLM's shape: ``lora_name`` names it (the server's ``model`` field), ``lora_int_id``
    (at least 1) identifies it inside the engine, and ``lora_path`` is its PEFT folder
    (``adapter_config.json`` and ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
