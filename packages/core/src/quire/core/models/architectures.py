"""The built-in architectures' registry entries (torch-free: config normalisation and checkpoint names).

A new family is its model file plus one ``register_model(ModelEntry(...))`` here.
"""

from __future__ import annotations

from typing import Any

from quire.core.errors import ConfigError
from quire.core.models.registry import FusedWeight, ModelEntry, WeightMapping, register_model

# Llama-shaped checkpoints store q/k/v and gate/up separately; the model fuses each group into one
# matrix multiply, so their tensors are stacked into ``qkv_proj`` and ``gate_up_proj``.
LLAMA_WEIGHTS = WeightMapping(
    fused=(
        FusedWeight(".qkv_proj.", ((".q_proj.", lambda c: c.num_attention_heads * c.head_dim),
                                   (".k_proj.", lambda c: c.num_key_value_heads * c.head_dim),
                                   (".v_proj.", lambda c: c.num_key_value_heads * c.head_dim))),
        FusedWeight(".gate_up_proj.", ((".gate_proj.", lambda c: c.intermediate_size),
                                       (".up_proj.", lambda c: c.intermediate_size))),
    ),
    skipped_suffixes=("rotary_emb.inv_freq",),
    tied_names=("lm_head.weight",),
)


def _check_llama_shaped(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise ConfigError("checkpoints with mlp_bias are not supported")


def llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral: ``attention_bias`` puts a bias on q/k/v and on o_proj."""
    _check_llama_shaped(hf)
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_proj_bias": bias, "qk_norm": False}


def qwen2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 always has a q/k/v bias and never an o_proj bias, whatever ``attention_bias`` says."""
    _check_llama_shaped(hf)
    return {"qkv_bias": True, "o_proj_bias": False, "qk_norm": False}


def qwen3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: Llama's biases plus an RMSNorm over each head's queries and keys."""
    return {**llama_fields(hf), "qk_norm": True}


# Mistral, Qwen2 and Qwen3 are Llama-shaped: one implementation serves all four names.
_LLAMA = ("quire.core.models.llama", "LlamaForCausalLM")
register_model(ModelEntry("LlamaForCausalLM", *_LLAMA, llama_fields, LLAMA_WEIGHTS, model_types=("llama",)))
register_model(ModelEntry("MistralForCausalLM", *_LLAMA, llama_fields, LLAMA_WEIGHTS, model_types=("mistral",)))
register_model(ModelEntry("Qwen2ForCausalLM", *_LLAMA, qwen2_fields, LLAMA_WEIGHTS, model_types=("qwen2",)))
register_model(ModelEntry("Qwen3ForCausalLM", *_LLAMA, qwen3_fields, LLAMA_WEIGHTS, model_types=("qwen3",)))
