"""Qwen2.5-VL's config.json as ModelConfig reads it: the language model's fields from ``text_config`` (transformers
5.x) or the top level (4.x, the Hub's files), the image token, the vision tower and M-RoPE settings, and the
variants Quire refuses by field name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from tests.multimodal.helpers import write_config

# A config.json in the layout of the Hub's Qwen2.5-VL-7B-Instruct (transformers 4.49): the language model's fields
# at the top level, M-RoPE as a rope_scaling of type "mrope", 4.x's ``in_chans`` and vision model_type.
HUB_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.49.0", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2,
                      "model_type": "qwen2_5_vl"},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")


def test_tiny_qwen2_5_vl_config(qwen2_5_vl_checkpoint):
    from transformers import AutoTokenizer

    hf = json.loads((qwen2_5_vl_checkpoint / "config.json").read_text())
    text = hf["text_config"]
    config = ModelConfig.from_hf(qwen2_5_vl_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(qwen2_5_vl_checkpoint)
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert config.is_multimodal and config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert hf["vision_start_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for name in TEXT_FIELDS:
        assert getattr(config, name) == text[name], name
    assert (config.head_dim, config.rope.theta, config.rope.rope_type) == (16, 10000.0, "default")
    assert (config.qkv_bias, config.o_proj_bias, config.qk_norm, config.tie_word_embeddings) == (
        True, False, False, False)
    assert config.eos_token_ids == (text["eos_token_id"],) == (tokenizer.convert_tokens_to_ids("<|endoftext|>"),)
    assert config.multimodal_config == {
        "vision_config": {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                          "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 32,
                          "out_hidden_size": 64, "fullatt_block_indexes": [1, 3], "hidden_act": "silu",
                          "rope_theta": 10000.0},
        "mrope_section": [2, 3, 3],
    }


def test_hub_config_reads_as_transformers_reads_it(tmp_path):
    from transformers import Qwen2_5_VLConfig

    config = ModelConfig.from_hf(write_config(tmp_path, HUB_CONFIG))
    reference = Qwen2_5_VLConfig.from_dict(HUB_CONFIG)
    text, vision = reference.text_config, reference.vision_config
    for name in TEXT_FIELDS:
        assert getattr(config, name) == getattr(text, name), name
    assert config.head_dim == text.hidden_size // text.num_attention_heads == 128
    assert config.rope.theta == text.rope_parameters["rope_theta"] == 1e6
    assert config.rope.rope_type == text.rope_parameters["rope_type"] == "default"
    assert config.multimodal_config["mrope_section"] == text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.image_token_id == reference.image_token_id == 151655
    assert config.dtype == "bfloat16" and config.eos_token_ids == (151645,) and not config.tie_word_embeddings
    assert config.max_model_len == 128000  # use_sliding_window is off: the window never caps the context
    settings = config.multimodal_config["vision_config"]
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "window_size", "out_hidden_size"):
        assert settings[name] == getattr(vision, name), name
    assert settings["fullatt_block_indexes"] == list(vision.fullatt_block_indexes)
    assert settings["rope_theta"] == vision.rope_parameters["rope_theta"]


def test_a_tied_head_at_either_level_ties(tmp_path, qwen2_5_vl_checkpoint):
    hf = json.loads((qwen2_5_vl_checkpoint / "config.json").read_text())
    hf["text_config"]["tie_word_embeddings"] = True
    assert ModelConfig.from_hf(write_config(tmp_path / "text", hf)).tie_word_embeddings
    assert ModelConfig.from_hf(write_config(tmp_path / "top", {**HUB_CONFIG, "tie_word_embeddings": True})
                               ).tie_word_embeddings


def vision(**change):
    return {"vision_config": {**HUB_CONFIG["vision_config"], **change}}


@pytest.mark.parametrize(("change", "field"), [
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 23]}}, "rope_parameters.mrope_section"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [32, 32]}}, "rope_parameters.mrope_section"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [16, 24, 24]}},
     "rope_parameters.rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"image_token_id": "<|image_pad|>"}, "image_token_id"),
    ({"vision_config": None}, "vision_config"),
    (vision(model_type="qwen3_vl"), "vision_config.model_type"),
    (vision(hidden_act="gelu_pytorch_tanh"), "vision_config.hidden_act"),
    (vision(num_heads=15), "vision_config.num_heads"),
    (vision(window_size=14), "vision_config.window_size"),
    (vision(fullatt_block_indexes=[7, 32]), "vision_config.fullatt_block_indexes"),
    (vision(out_hidden_size=2048), "vision_config.out_hidden_size"),
    (vision(patch_size=[14, 14]), "vision_config.patch_size"),
    (vision(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "vision_config.rope_parameters"),
])
def test_unsupported_variants_are_refused_by_field(tmp_path, change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(write_config(tmp_path, {**HUB_CONFIG, **change}))


def test_nested_text_config_errors_name_it(tmp_path, qwen2_5_vl_checkpoint):
    hf = json.loads((qwen2_5_vl_checkpoint / "config.json").read_text())
    hf["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 4]
    with pytest.raises(ConfigError, match=r"text_config\.rope_parameters\.mrope_section .* = 8"):
        ModelConfig.from_hf(write_config(tmp_path, hf))


def test_reading_a_qwen2_5_vl_config_imports_no_torch(qwen2_5_vl_checkpoint):
    code = ("import sys; from quire.core.config import ModelConfig; "
            f"assert ModelConfig.from_hf({str(qwen2_5_vl_checkpoint)!r}).is_multimodal; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
