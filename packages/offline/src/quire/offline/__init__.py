"""Offline batch generation with Quire: ``from quire.offline import LLM``.

Names are exported lazily so importing the package stays cheap.
"""

import importlib

_EXPORTS = {
    "LLM": "quire.offline.llm",
    "SamplingParams": "quire.core.sampling_params",
    "RequestOutput": "quire.core.outputs",
    "CompletionOutput": "quire.core.outputs",
    "LoRARequest": "quire.core.lora.request",
    "PoolingParams": "quire.core.pooling_params",
    "PoolingRequestOutput": "quire.core.outputs",
    "ScoringRequestOutput": "quire.core.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'quire.offline' has no attribute {name!r}")
