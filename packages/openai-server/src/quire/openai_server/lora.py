"""The server's LoRA adapters by name: those of ``--lora-modules``, and with
``--enable-lora-runtime-updates`` those loaded and unloaded at run time (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``). A request names its adapter in ``model``."""

from __future__ import annotations

from quire.core.config import ModelConfig
from quire.core.errors import NotFoundError, ValidationError
from quire.core.lora.adapter_config import read_adapter_config
from quire.core.lora.request import LoRARequest


class LoRAAdapters:
    """Adapters by name, each given a fresh engine id when it is loaded (so an adapter unloaded and loaded
    again from another folder is another adapter to the engine and its prefix cache)."""

    def __init__(self):
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def __iter__(self):
        return iter(self._by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def load(self, name: str, path: str, model: ModelConfig, max_lora_rank: int,
             reserved_names: list[str]) -> LoRARequest:
        """Check the folder against the base model and add it under ``name``; ValidationError (400) for a
        name in use or an adapter the engine cannot apply."""
        if not name:
            raise ValidationError("lora_name must not be empty", param="lora_name")
        if name in self._by_name or name in reserved_names:
            raise ValidationError(f"the name {name!r} is already in use", param="lora_name")
        if not path:
            raise ValidationError("lora_path must not be empty", param="lora_path")
        read_adapter_config(path, max_lora_rank, model, param="lora_path")
        adapter = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget ``name`` (requests already running with it finish); NotFoundError (404) if unknown."""
        if self._by_name.pop(name, None) is None:
            raise NotFoundError(f"no LoRA adapter named {name!r}")


def parse_lora_module(value: str) -> tuple[str, str]:
    """``name=path`` (``--lora-modules``)."""
    name, separator, path = value.partition("=")
    if not separator or not name or not path:
        raise ValueError(f"expected name=path, got {value!r}")
    return name, path
