"""LLaVA's config.json as ModelConfig reads it: the text model's fields, the image token, the vision tower's
settings, transformers 4.x files that leave defaults out, and the variants Quire refuses by field name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from tests.multimodal.helpers import write_config

# llava-hf/llava-1.5-7b-hf's config.json (transformers 4.36): the sub-configs list only what differs from
# LlamaConfig's and CLIPVisionConfig's defaults.
LLAVA_15_7B_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_tiny_llava_config(llava_checkpoint):
    from transformers import AutoProcessor

    from quire.core.testing.multimodal_checkpoints import IMAGE_TOKEN
    from quire.core.testing.multimodal_checkpoints import sample_image as make_image

    hf = json.loads((llava_checkpoint / "config.json").read_text())
    text = hf["text_config"]
    config = ModelConfig.from_hf(llava_checkpoint)
    processor = AutoProcessor.from_pretrained(llava_checkpoint)
    image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert config.architecture == "LlavaForConditionalGeneration"
    assert config.is_multimodal and config.image_token_id == image_token_id
    # the language model's shape, which differs from the vision tower's (hidden 64 vs 48, 2 vs 3 layers)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(config, name) == text[name], name
    assert (config.qkv_bias, config.o_proj_bias, config.qk_norm, config.tie_word_embeddings) == (False,) * 4
    assert config.eos_token_ids == (text["eos_token_id"],)
    assert config.multimodal_config == {
        "vision_config": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "num_channels": 3,
                          "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"},
        "vision_feature_layer": 2,  # -2 of the tower's 4 hidden states
        "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu", "projector_bias": True,
        "num_image_tokens": 16,
    }
    # the processor expands one <image> into as many placeholders as the model gives embeddings
    prompt = processor(text=IMAGE_TOKEN, images=make_image(40, 24), return_tensors="pt")
    assert (prompt["input_ids"] == image_token_id).sum() == config.multimodal_config["num_image_tokens"]


def test_transformers_4_config_gets_the_defaults_it_leaves_out(tmp_path):
    config = ModelConfig.from_hf(write_config(tmp_path, LLAVA_15_7B_CONFIG))
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        32064, 4096, 11008, 32, 32, 32, 128)
    assert (config.max_position_embeddings, config.rms_norm_eps, config.rope.theta) == (4096, 1e-5, 10000.0)
    assert config.dtype == "bfloat16"  # float16 checkpoints run in bfloat16 on CPUs
    assert config.image_token_id == 32000 and not config.tie_word_embeddings
    settings = config.multimodal_config
    assert settings["vision_config"]["hidden_act"] == "quick_gelu"  # CLIPVisionConfig's default
    assert settings["vision_config"]["layer_norm_eps"] == 1e-5
    assert settings["vision_feature_layer"] == 23 and settings["num_image_tokens"] == 576


def test_a_tied_head_at_either_level_ties(tmp_path):
    text = {**LLAVA_15_7B_CONFIG["text_config"], "tie_word_embeddings": False}
    config = ModelConfig.from_hf(write_config(tmp_path, {**LLAVA_15_7B_CONFIG, "tie_word_embeddings": True,
                                                         "text_config": text}))
    assert config.tie_word_embeddings


@pytest.mark.parametrize(("change", "field"), [
    ({"vision_feature_layer": [-2, -5]}, "vision_feature_layer"),
    ({"vision_feature_layer": 25}, "vision_feature_layer"),
    ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
    ({"image_token_index": "<image>"}, "image_token_index"),
    ({"vision_config": {**LLAVA_15_7B_CONFIG["vision_config"], "model_type": "siglip_vision_model"}},
     "vision_config.model_type"),
    ({"vision_config": {**LLAVA_15_7B_CONFIG["vision_config"], "hidden_act": "relu"}}, "vision_config.hidden_act"),
    ({"text_config": {**LLAVA_15_7B_CONFIG["text_config"], "model_type": "gemma"}}, "text_config.model_type"),
    ({"text_config": {**LLAVA_15_7B_CONFIG["text_config"], "hidden_act": "gelu"}}, "text_config: hidden_act"),
    ({"text_config": None}, "text_config"),
])
def test_unsupported_variants_are_refused_by_field(tmp_path, change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(write_config(tmp_path, {**LLAVA_15_7B_CONFIG, **change}))


def test_reading_a_llava_config_imports_no_torch(llava_checkpoint):
    code = ("import sys; from quire.core.config import ModelConfig; "
            f"assert ModelConfig.from_hf({str(llava_checkpoint)!r}).is_multimodal; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
