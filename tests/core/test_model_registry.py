"""Registry entries per architecture: config normalisation, checkpoint names, lazy model classes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.models import check_architecture, get_model_class, get_model_entry, supported_architectures

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def fields_before_the_registry(hf: dict) -> dict:
    """The architecture-specific fields as ``ModelConfig.from_hf`` computed them before it asked the registry."""
    architecture, bias = hf["architectures"][0], bool(hf.get("attention_bias", False))
    return {"qkv_bias": architecture == "Qwen2ForCausalLM" or bias,
            "o_proj_bias": architecture != "Qwen2ForCausalLM" and bias,
            "qk_norm": architecture == "Qwen3ForCausalLM"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_entries_give_the_fields_from_hf_gave_before(tiny_checkpoint, tmp_path, arch):
    hf = json.loads((tiny_checkpoint(arch) / "config.json").read_text())
    for architecture in ARCHITECTURES:
        for attention_bias in (False, True):
            (tmp_path / "config.json").write_text(json.dumps(
                {**hf, "architectures": [architecture], "attention_bias": attention_bias}))
            config = ModelConfig.from_hf(tmp_path)
            expected = fields_before_the_registry({**hf, "architectures": [architecture],
                                                   "attention_bias": attention_bias})
            assert {name: getattr(config, name) for name in expected} == expected, (architecture, attention_bias)


def test_model_type_names_the_architecture_when_none_is_listed(tiny_checkpoint, tmp_path):
    hf = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
    del hf["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_hf(tmp_path)
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm


def test_unknown_architecture_is_refused_clearly(llama_checkpoint, tmp_path):
    hf = json.loads((llama_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": ["GemmaForCausalLM"]}))
    supported = "BertForSequenceClassification, BertModel, Gemma3ForCausalLM, LlamaForCausalLM"
    with pytest.raises(ConfigError, match=f"'GemmaForCausalLM' is not supported; supported: {supported}"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="GemmaForCausalLM"):
        check_architecture("GemmaForCausalLM")
    del hf["architectures"]
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "gemma"}))
    with pytest.raises(ConfigError, match="model_type 'gemma' is unknown"):
        ModelConfig.from_hf(tmp_path)


def test_weight_mapping_stacks_llama_projections(llama_checkpoint):
    config = ModelConfig.from_hf(llama_checkpoint)
    weights = get_model_entry("LlamaForCausalLM").weights
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    layer = "model.layers.0"
    assert weights.target(f"{layer}.self_attn.v_proj.weight", config) == (
        f"{layer}.self_attn.qkv_proj.weight", q_rows + kv_rows)
    assert weights.target(f"{layer}.mlp.up_proj.weight", config) == (
        f"{layer}.mlp.gate_up_proj.weight", config.intermediate_size)
    assert weights.target("model.norm.weight", config) == ("model.norm.weight", 0)
    assert weights.expected_shards([f"{layer}.self_attn.qkv_proj.weight"], config) == {
        (f"{layer}.self_attn.qkv_proj.weight", offset) for offset in (0, q_rows, q_rows + kv_rows)}
    assert weights.is_skipped(f"{layer}.self_attn.rotary_emb.inv_freq", config)
    assert not weights.is_skipped("lm_head.weight", config)  # the tiny llama has its own head


def test_registry_and_config_import_no_torch_and_classes_load_lazily():
    code = ("import sys; from quire.core.config import ModelConfig; "
            "from quire.core.models import supported_architectures; supported_architectures(); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert supported_architectures() == sorted([*ARCHITECTURES, "LlavaForConditionalGeneration",
                                                "Qwen2_5_VLForConditionalGeneration", "Phi3ForCausalLM",
                                                "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                                                "BertModel", "BertForSequenceClassification"])
    assert {get_model_class(name).__name__ for name in [*ARCHITECTURES, "Phi3ForCausalLM"]} == {"LlamaForCausalLM"}
    assert get_model_class("LlavaForConditionalGeneration").__name__ == "LlavaForConditionalGeneration"
    assert get_model_class("Gemma3ForCausalLM").__name__ == "Gemma3ForCausalLM"
    assert get_model_class("BertModel").__name__ == "BertModel"
    assert get_model_class("BertForSequenceClassification").__name__ == "BertForSequenceClassification"
    assert get_model_class("Qwen2_5_VLForConditionalGeneration").__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert {get_model_class(name).__name__ for name in ("MixtralForCausalLM", "Qwen3MoeForCausalLM")} == {
        "MoeForCausalLM"}
