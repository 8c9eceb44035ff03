"""Model architectures, registered by Hugging Face architecture name and imported lazily."""

from __future__ import annotations

import importlib

from quire.core.errors import ConfigError

# Mistral, Qwen2 and Qwen3 are Llama-shaped; ModelConfig.from_hf records what differs (q/k/v bias,
# q/k norm), so one implementation serves all four names.
_MODELS = {
    "LlamaForCausalLM": ("quire.core.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("quire.core.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("quire.core.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("quire.core.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: "
                          f"{', '.join(supported_architectures())}")


def get_model_class(architecture: str):
    check_architecture(architecture)
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
