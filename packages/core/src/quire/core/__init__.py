"""Quire's engine core: scheduler, paged KV cache, model runner and engine clients.

Names are exported lazily, so ``import quire.core`` loads neither torch nor transformers.
"""

import importlib

_EXPORTS = {
    "SamplingParams": "quire.core.sampling_params",
    "RequestOutputKind": "quire.core.sampling_params",
    "RequestOutput": "quire.core.outputs",
    "CompletionOutput": "quire.core.outputs",
    "EngineArgs": "quire.core.engine_args",
    "LLMEngine": "quire.core.engine.llm_engine",
    "AsyncLLM": "quire.core.engine.async_llm",
    "EngineClient": "quire.core.engine.protocol",
    "SyncEngineClient": "quire.core.engine.protocol",
    "StatLogger": "quire.core.engine.protocol",
    "EngineMetrics": "quire.core.outputs",
    "ChatPrompt": "quire.core.renderer",
    "Renderer": "quire.core.renderer",
    "QuireError": "quire.core.errors",
    "ValidationError": "quire.core.errors",
    "NotFoundError": "quire.core.errors",
    "OverloadedError": "quire.core.errors",
    "EngineDeadError": "quire.core.errors",
    "EngineGenerateError": "quire.core.errors",
    "ConfigError": "quire.core.errors",
    "EngineUtilityError": "quire.core.errors",
    "demo_model_path": "quire.core.demo",
    "DEMO_MODEL_NAME": "quire.core.demo",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'quire.core' has no attribute {name!r}")
