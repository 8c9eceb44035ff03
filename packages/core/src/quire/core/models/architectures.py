"""The built-in architectures' registry entries (torch-free: config normalisation and checkpoint names).

A new family is its model file plus one ``register_model(ModelEntry(...))`` here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from quire.core.errors import ConfigError
from quire.core.models.registry import FusedWeight, ModelEntry, WeightMapping, register_model

if TYPE_CHECKING:
    from quire.core.config import ModelConfig

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
register_model(ModelEntry("LlamaForCausalLM", *_LLAMA, llama_fields, LLAMA_WEIGHTS, model_types=("llama",),
                           supports_tensor_parallel=True))
register_model(ModelEntry("MistralForCausalLM", *_LLAMA, llama_fields, LLAMA_WEIGHTS, model_types=("mistral",),
                           supports_tensor_parallel=True))
register_model(ModelEntry("Qwen2ForCausalLM", *_LLAMA, qwen2_fields, LLAMA_WEIGHTS, model_types=("qwen2",),
                           supports_tensor_parallel=True))
register_model(ModelEntry("Qwen3ForCausalLM", *_LLAMA, qwen3_fields, LLAMA_WEIGHTS, model_types=("qwen3",),
                           supports_tensor_parallel=True))


# LLaVA-1.5: a CLIP vision tower and a two-layer projector in front of a Llama-shaped language model.
_LLAVA_TEXT_FIELDS = {"llama": llama_fields, "mistral": llama_fields, "qwen2": qwen2_fields}
# transformers 4.x wrote only the sub-config values that differ from their class's defaults (llava-hf's
# llava-1.5 text_config names no layer count), so LlamaConfig's and CLIPVisionConfig's defaults fill in what
# Quire reads; other text model types must spell out the shape. The top-level defaults are LlavaConfig's.
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
_TEXT_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_CLIP_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                         "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "num_channels": 3,
                         "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"}
_CLIP_ACTIVATIONS = ("quick_gelu", "gelu")


def _sub_config(hf: dict[str, Any], key: str) -> dict[str, Any]:
    sub = hf.get(key)
    if not isinstance(sub, dict):
        raise ConfigError(f"{key} is missing from config.json")
    return sub


def llava_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields, Llama's defaults filled in; ``tie_word_embeddings`` as
    LlavaConfig reads it (either level may set it)."""
    text = _sub_config(hf, "text_config")
    if text.get("model_type", "llama") == "llama":
        text = {**_LLAMA_DEFAULTS, **text}
    missing = [key for key in _TEXT_SHAPE_KEYS if key not in text]
    if missing:
        raise ConfigError(f"text_config has no {', '.join(missing)}")
    return {**text, "tie_word_embeddings": bool(hf.get("tie_word_embeddings") or text.get("tie_word_embeddings"))}


def llava_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields, ``image_token_id`` and ``multimodal_config`` (what ``models.llava`` reads):

    ``vision_config``: the CLIP tower's shape (the keys of ``_CLIP_VISION_DEFAULTS``);
    ``vision_feature_layer``: the index of the hidden state fed to the projector, counted from the embeddings
    (0) up, so also the number of encoder layers that run; ``vision_feature_select_strategy``: ``default``
    drops the class token, ``full`` keeps it; ``projector_hidden_act``, ``projector_bias``;
    ``num_image_tokens``: the embeddings one image becomes.
    """
    text_type = (hf.get("text_config") or {}).get("model_type", "llama")
    if text_type not in _LLAVA_TEXT_FIELDS:
        raise ConfigError(f"text_config.model_type {text_type!r} is not supported under LLaVA (supported: "
                          f"{', '.join(_LLAVA_TEXT_FIELDS)})")
    text = llava_text_config(hf)
    try:
        fields = _LLAVA_TEXT_FIELDS[text_type](text)
    except ConfigError as error:
        raise ConfigError(f"text_config: {error}") from error
    vision_type = (hf.get("vision_config") or {}).get("model_type", "clip_vision_model")
    if vision_type != "clip_vision_model":
        raise ConfigError(f"vision_config.model_type {vision_type!r} is not supported (only clip_vision_model)")
    vision = _sub_config(hf, "vision_config")
    vision = {key: vision.get(key, default) for key, default in _CLIP_VISION_DEFAULTS.items()}
    if vision["hidden_act"] not in _CLIP_ACTIVATIONS:
        raise ConfigError(f"vision_config.hidden_act {vision['hidden_act']!r} is not supported "
                          f"(supported: {', '.join(_CLIP_ACTIVATIONS)})")
    feature_layer = _vision_feature_layer(hf.get("vision_feature_layer", -2), vision["num_hidden_layers"])
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ConfigError(f"vision_feature_select_strategy must be default or full, got {strategy!r}")
    projector_act = hf.get("projector_hidden_act", "gelu")
    if projector_act != "gelu":
        raise ConfigError(f"projector_hidden_act {projector_act!r} is not supported (only gelu)")
    image_token_id = hf.get("image_token_index", hf.get("image_token_id", 32000))
    if not isinstance(image_token_id, int) or isinstance(image_token_id, bool):
        raise ConfigError(f"image_token_index must be a token id, got {image_token_id!r}")
    num_patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return {**fields, "image_token_id": image_token_id, "multimodal_config": {
        "vision_config": vision,
        "vision_feature_layer": feature_layer,
        "vision_feature_select_strategy": strategy,
        "projector_hidden_act": projector_act,
        "projector_bias": bool(hf.get("multimodal_projector_bias", True)),
        "num_image_tokens": num_patches + (strategy == "full"),
    }}


def _vision_feature_layer(layer: Any, num_layers: int) -> int:
    """``vision_feature_layer`` as an index into the tower's ``num_layers + 1`` hidden states (negative ones
    count from the last layer's output, as in transformers)."""
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ConfigError(f"vision_feature_layer must be one layer index, got {layer!r} (features concatenated "
                          "from several layers are not supported)")
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ConfigError(f"vision_feature_layer {layer} is outside the vision tower's {num_layers} layers")
    return layer % (num_layers + 1)


def _llava_unused_weight(name: str, config: ModelConfig) -> bool:
    """The tower's layers past the feature layer, and its post-layernorm (which only CLIP's pooled output
    uses), are not built."""
    if name.startswith("vision_tower.post_layernorm."):
        return True
    prefix = "vision_tower.encoder.layers."
    if not name.startswith(prefix):
        return False
    return int(name[len(prefix):].split(".", 1)[0]) >= config.multimodal_config["vision_feature_layer"]


def _vision_hidden_size(config: ModelConfig) -> int:
    return config.multimodal_config["vision_config"]["hidden_size"]


# The model's names are those transformers 5.x saves: a LlamaForCausalLM under ``language_model`` and the CLIP
# tower without the ``vision_model`` level of 4.x files (llava-hf's on the Hub); transformers 5.x's module
# names (``model.language_model.``, ``lm_head.``, …) are read too.
LLAVA_WEIGHTS = WeightMapping(
    fused=(*(dataclasses.replace(fused, scope="language_model.") for fused in LLAMA_WEIGHTS.fused),
           FusedWeight(".qkv_proj.", ((".q_proj.", _vision_hidden_size), (".k_proj.", _vision_hidden_size),
                                      (".v_proj.", _vision_hidden_size)), scope="vision_tower.")),
    skipped_suffixes=LLAMA_WEIGHTS.skipped_suffixes,
    tied_names=("language_model.lm_head.weight",),
    renamed_prefixes=(
        ("model.language_model.", "language_model.model."),  # transformers 5.x module names
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("vision_tower.vision_model.", "vision_tower."),  # transformers 4.x files
    ),
    is_unused=_llava_unused_weight,
)
register_model(ModelEntry("LlavaForConditionalGeneration", "quire.core.models.llava", "LlavaForConditionalGeneration",
                          llava_fields, LLAVA_WEIGHTS, model_types=("llava",), text_config=llava_text_config))


# Qwen2.5-VL: a windowed-attention vision transformer whose merged patches feed a Qwen2 language model that
# rotates by three position rows (M-RoPE). Checkpoints nest the language model's config in ``text_config``
# (transformers 5.x) or keep it at the top level (4.x, the Hub's files).
_QWEN_VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
                         "in_channels": 3, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
                         "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
                         "hidden_act": "silu"}
_QWEN_VL_TEXT_THETA = 1000000.0  # Qwen2_5_VLTextConfig's default rope_theta


def _token_id(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{field} must be a token id, got {value!r}")
    return value


def _text_rope(text: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (5.x) or ``rope_scaling`` (4.x, whose ``mrope`` type means the default frequencies)."""
    return dict(text.get("rope_parameters") or text.get("rope_scaling") or {})


def _qwen_vl_raw_text(hf: dict[str, Any]) -> dict[str, Any]:
    return {**{key: value for key, value in hf.items() if key not in ("text_config", "vision_config")},
            **(hf.get("text_config") or {})}


def qwen2_5_vl_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields: ``text_config`` over the top level (either may hold them), the
    rotary parameters as plain default rope (M-RoPE's split is in ``multimodal_config``); ``tie_word_embeddings``
    as Qwen2_5_VLConfig reads it (either level may set it)."""
    text = _qwen_vl_raw_text(hf)
    missing = [key for key in _TEXT_SHAPE_KEYS if key not in text]
    if missing:
        raise ConfigError(f"text_config has no {', '.join(missing)}")
    rope = _text_rope(text)
    theta = rope.get("rope_theta", text.get("rope_theta", _QWEN_VL_TEXT_THETA))
    return {**text, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings") or text.get("tie_word_embeddings"))}


def qwen2_5_vl_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's fields, ``image_token_id`` and ``multimodal_config`` (what ``models.qwen2_5_vl`` reads):

    ``vision_config``: the vision tower's shape (the keys of ``_QWEN_VISION_DEFAULTS``, 4.x's ``in_chans`` read as
    ``in_channels``) and ``rope_theta``; ``mrope_section``: how many of the language model's rotary frequencies
    follow each of the t, h and w position rows (summing to ``head_dim // 2``).
    """
    text = qwen2_5_vl_text_config(hf)
    prefix = "text_config." if hf.get("text_config") else ""
    try:
        fields = qwen2_fields(text)
    except ConfigError as error:
        raise ConfigError(f"{prefix}{error}") from error
    rope = _text_rope(_qwen_vl_raw_text(hf))
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{prefix}rope_parameters.rope_type {rope_type!r} is not supported (only default M-RoPE)")
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    section = rope.get("mrope_section", [16, 24, 24])  # Qwen2_5_VLRotaryEmbedding's default
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(isinstance(n, int) and n > 0 for n in section) or sum(section) != head_dim // 2):
        raise ConfigError(f"{prefix}rope_parameters.mrope_section must be three positive counts summing to "
                          f"head_dim // 2 = {head_dim // 2}, got {section!r}")
    return {**fields, "image_token_id": _token_id(hf.get("image_token_id", 151655), "image_token_id"),
            "multimodal_config": {"vision_config": _qwen_vision_config(hf, text), "mrope_section": list(section)}}


def _qwen_vision_config(hf: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    raw = _sub_config(hf, "vision_config")
    vision_type = raw.get("model_type", "qwen2_5_vl_vision")
    if vision_type not in ("qwen2_5_vl_vision", "qwen2_5_vl"):
        raise ConfigError(f"vision_config.model_type {vision_type!r} is not supported (only qwen2_5_vl_vision)")
    raw = {**raw, "in_channels": raw.get("in_channels", raw.get("in_chans", 3))}
    vision = {key: raw.get(key, default) for key, default in _QWEN_VISION_DEFAULTS.items()}
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                "temporal_patch_size", "spatial_merge_size", "window_size", "out_hidden_size"):
        if not isinstance(vision[key], int) or isinstance(vision[key], bool) or vision[key] < 1:
            raise ConfigError(f"vision_config.{key} must be a positive integer, got {vision[key]!r}")
    if vision["hidden_act"] != "silu":
        raise ConfigError(f"vision_config.hidden_act {vision['hidden_act']!r} is not supported (only silu)")
    head_dim, remainder = divmod(vision["hidden_size"], vision["num_heads"])
    if remainder or head_dim % 4:
        raise ConfigError(f"vision_config.num_heads {vision['num_heads']} must split hidden_size "
                          f"{vision['hidden_size']} into heads whose size is a multiple of 4 (2-D rotary)")
    if vision["window_size"] < vision["spatial_merge_size"] * vision["patch_size"]:
        raise ConfigError(f"vision_config.window_size {vision['window_size']} is smaller than one merged patch "
                          f"({vision['spatial_merge_size']} x {vision['patch_size']} pixels)")
    indexes = vision["fullatt_block_indexes"]
    if not isinstance(indexes, (list, tuple)) or not all(
            isinstance(i, int) and 0 <= i < vision["depth"] for i in indexes):
        raise ConfigError(f"vision_config.fullatt_block_indexes must be block indexes below depth "
                          f"{vision['depth']}, got {indexes!r}")
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ConfigError(f"vision_config.out_hidden_size {vision['out_hidden_size']} differs from the language "
                          f"model's hidden_size {text['hidden_size']}")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported "
                          "(only axial)")
    return {**vision, "fullatt_block_indexes": list(indexes), "rope_theta": float(rope.get("rope_theta", 10000.0))}


def _qwen_vision_intermediate_size(config: ModelConfig) -> int:
    return config.multimodal_config["vision_config"]["intermediate_size"]


# The model's names are the Hub's (``visual.``; the language model's ``model.`` and ``lm_head.``, which
# transformers 5.24 also saves) under a ``language_model`` LlamaForCausalLM; transformers 5.x's module names
# (``model.language_model.``, ``model.visual.``) are read too. The vision blocks' gate/up are fused like the
# language model's; their q/k/v come fused already (``attn.qkv``).
QWEN2_5_VL_WEIGHTS = WeightMapping(
    fused=(*(dataclasses.replace(fused, scope="language_model.") for fused in LLAMA_WEIGHTS.fused),
           FusedWeight(".gate_up_proj.", ((".gate_proj.", _qwen_vision_intermediate_size),
                                          (".up_proj.", _qwen_vision_intermediate_size)), scope="visual.")),
    skipped_suffixes=LLAMA_WEIGHTS.skipped_suffixes,
    tied_names=("language_model.lm_head.weight",),
    renamed_prefixes=(
        ("model.language_model.", "language_model.model."),  # transformers 5.x module names
        ("model.visual.", "visual."),
        ("model.", "language_model.model."),  # the Hub's files
        ("lm_head.", "language_model.lm_head."),
    ),
)
register_model(ModelEntry("Qwen2_5_VLForConditionalGeneration", "quire.core.models.qwen2_5_vl",
                          "Qwen2_5_VLForConditionalGeneration", qwen2_5_vl_fields, QWEN2_5_VL_WEIGHTS,
                          model_types=("qwen2_5_vl",), text_config=qwen2_5_vl_text_config))
