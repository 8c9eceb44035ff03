"""The built-in architectures' registry entries (torch-free: config normalisation and checkpoint names).

A new family is its model file plus one ``register_model(ModelEntry(...))`` here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from quire.core.errors import ConfigError
from quire.core.models.registry import ExpertWeight, FusedWeight, ModelEntry, WeightMapping, register_model

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


def mistral_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's fields, and ``sliding_window`` on every layer (MistralConfig's default of 4096 where the key is
    missing; null: none). Mistral ignores ``layer_types``, as transformers' MistralModel does."""
    window = hf.get("sliding_window", 4096)
    return {**llama_fields(hf), "sliding_window": _window(window, "sliding_window")}


def qwen_window_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 and Qwen3: ``sliding_window`` only with ``use_sliding_window`` (otherwise it is ignored), on the
    layers ``layer_types`` marks, or by default on layers ``max_window_layers`` and above."""
    if not hf.get("use_sliding_window", False):
        return {}
    window = _window(hf.get("sliding_window", 4096), "sliding_window")
    if window is None:
        return {}
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first_windowed = int(hf.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"layer_types must name full_attention or sliding_attention for each of the "
                          f"{num_layers} layers, got {layer_types!r}")
    return {"sliding_window": window, "layer_types": tuple(layer_types)}


def _window(value: Any, field: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{field} must be a positive number of tokens or null, got {value!r}")
    return value


def qwen2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 always has a q/k/v bias and never an o_proj bias, whatever ``attention_bias`` says."""
    _check_llama_shaped(hf)
    return {"qkv_bias": True, "o_proj_bias": False, "qk_norm": False, **qwen_window_fields(hf)}


def qwen3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: Llama's biases plus an RMSNorm over each head's queries and keys."""
    return {**llama_fields(hf), "qk_norm": True, **qwen_window_fields(hf)}


# Mistral, Qwen2 and Qwen3 are Llama-shaped: one implementation serves all four names.
_LLAMA = ("quire.core.models.llama", "LlamaForCausalLM")
register_model(ModelEntry("LlamaForCausalLM", *_LLAMA, llama_fields, LLAMA_WEIGHTS, model_types=("llama",),
                           supports_tensor_parallel=True))
register_model(ModelEntry("MistralForCausalLM", *_LLAMA, mistral_fields, LLAMA_WEIGHTS, model_types=("mistral",),
                           supports_tensor_parallel=True))
register_model(ModelEntry("Qwen2ForCausalLM", *_LLAMA, qwen2_fields, LLAMA_WEIGHTS, model_types=("qwen2",),
                           supports_tensor_parallel=True))
register_model(ModelEntry("Qwen3ForCausalLM", *_LLAMA, qwen3_fields, LLAMA_WEIGHTS, model_types=("qwen3",),
                           supports_tensor_parallel=True))


# Phi-3 and Phi-4-mini: Llama-shaped, with q/k/v and gate/up fused in the checkpoint already (under the model's
# own names, so nothing is stacked); LongRoPE and partial rotary arrive through ``RopeConfig``. Not split for
# tensor parallelism: a rank's rows of a fused checkpoint tensor are not one slice of it.
PHI3_WEIGHTS = WeightMapping(skipped_suffixes=LLAMA_WEIGHTS.skipped_suffixes, tied_names=LLAMA_WEIGHTS.tied_names)
_PHI3_ROPE_TYPES = ("default", "longrope", "su")


def phi3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: no biases, ``sliding_window`` (null: none) on every layer, rope ``default`` or ``longrope``
    (once ``su``). A longrope config names ``original_max_position_embeddings`` at the top level, as Phi-3's
    do (transformers' Phi3Config would put its default of 4096 over the one in ``rope_scaling``)."""
    _check_llama_shaped(hf)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in _PHI3_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported for Phi-3 (supported: default, longrope)")
    if rope_type != "default" and "original_max_position_embeddings" not in hf:
        raise ConfigError("a longrope config must name original_max_position_embeddings at the top level")
    return {"qkv_bias": False, "o_proj_bias": False, "qk_norm": False,
            "sliding_window": _window(hf.get("sliding_window"), "sliding_window")}


register_model(ModelEntry("Phi3ForCausalLM", *_LLAMA, phi3_fields, PHI3_WEIGHTS, model_types=("phi3",)))


# BERT encoders (sentence-transformers embedding models): q/k/v stacked into one projection, transformers'
# ``LayerNorm`` (once ``gamma``/``beta``) named ``layer_norm``; a ``bert.`` prefix (checkpoints saved from a
# task model) dropped; the pooler and any MLM head are not built.
BERT_WEIGHTS = WeightMapping(
    fused=(FusedWeight(".attention.qkv_proj.", tuple((f".attention.self.{name}.", lambda c: c.hidden_size)
                                                     for name in ("query", "key", "value"))),),
    renamed_prefixes=(("bert.", ""),),
    renamed_parts=((".LayerNorm.gamma", ".layer_norm.weight"), (".LayerNorm.beta", ".layer_norm.bias"),
                   (".LayerNorm.", ".layer_norm.")),
    skipped_suffixes=("position_ids",),
    is_unused=lambda name, config: name.startswith(("pooler.", "cls.")),
)
_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu_fast": "gelu_tanh", "relu": "relu"}


def bert_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """BERT: bidirectional attention, absolute positions, token types, LayerNorm (BertConfig's defaults where
    config.json leaves a key out)."""
    activation = hf.get("hidden_act", "gelu")
    if activation not in _BERT_ACTIVATIONS:
        raise ConfigError(f"hidden_act {activation!r} is not supported for BERT "
                          f"(supported: {', '.join(_BERT_ACTIVATIONS)})")
    position_type = hf.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ConfigError(f"position_embedding_type {position_type!r} is not supported for BERT (only absolute)")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ConfigError("BERT checkpoints with is_decoder or add_cross_attention are not supported")
    num_token_types = hf.get("type_vocab_size", 2)
    if not isinstance(num_token_types, int) or isinstance(num_token_types, bool) or num_token_types < 1:
        raise ConfigError(f"type_vocab_size must be a positive integer, got {num_token_types!r}")
    return {"is_causal": False, "layer_norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
            "num_token_types": num_token_types, "encoder_activation": _BERT_ACTIVATIONS[activation]}


register_model(ModelEntry("BertModel", "quire.core.models.bert", "BertModel", bert_fields, BERT_WEIGHTS,
                          model_types=("bert",)))


def bert_classifier_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A BERT cross-encoder: BERT, then the pooler (dense + tanh on ``[CLS]``) and one relevance logit."""
    num_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # BertConfig's default: 2
    if num_labels != 1:
        raise ConfigError(f"BertForSequenceClassification with {num_labels} labels: Quire runs cross-encoders "
                          "that score a text pair with one logit (num_labels 1)")
    return {**bert_fields(hf), "num_labels": num_labels}


# The classification head (``bert.pooler.dense``, ``classifier``) is built; an MLM head is not.
BERT_CLASSIFIER_WEIGHTS = dataclasses.replace(BERT_WEIGHTS, is_unused=lambda name, config: name.startswith("cls."))
register_model(ModelEntry("BertForSequenceClassification", "quire.core.models.bert", "BertForSequenceClassification",
                          bert_classifier_fields, BERT_CLASSIFIER_WEIGHTS))


# LLaVA-1.5: a CLIP vision tower and a two-layer projector in front of a Llama-shaped language model.
_LLAVA_TEXT_FIELDS = {"llama": llama_fields, "mistral": mistral_fields, "qwen2": qwen2_fields}
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


# Gemma 3 (text): Llama's checkpoint names plus four norms per layer (``pre_feedforward_layernorm`` and
# ``post_feedforward_layernorm`` besides Llama's two) and ``q_norm``/``k_norm``; sliding-window layers interleaved
# with full-attention ones, each kind with its own rotary base. Gemma3ForConditionalGeneration (vision) is not
# registered. Configs may leave fields to Gemma3TextConfig's defaults (the Hub's files name no
# ``tie_word_embeddings``, which is true), so those fill in what Quire reads.
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "bos_token_id": 2, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
                    "query_pre_attn_scalar": 256, "sliding_window": 4096}
_GEMMA3_GLOBAL_THETA, _GEMMA3_LOCAL_THETA = 1000000.0, 10000.0
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma3_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rotary parameters of full-attention and of sliding-window layers: 5.x's ``rope_parameters`` holds
    one dict per layer type; 4.x had ``rope_theta`` and ``rope_scaling`` (full attention) beside
    ``rope_local_base_freq`` (sliding window)."""
    params = hf.get("rope_parameters")
    if params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", _GEMMA3_GLOBAL_THETA)}
        local = {"rope_theta": hf.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA)}
    full.setdefault("rope_theta", _GEMMA3_GLOBAL_THETA)
    local.setdefault("rope_theta", _GEMMA3_LOCAL_THETA)
    return full, local


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields over Gemma3TextConfig's defaults, with the full-attention layers' rotary parameters
    as the model's ``rope_parameters`` (the sliding-window layers' base is ``local_rope_theta``)."""
    full_rope, _ = _gemma3_rope(hf)
    return {**_GEMMA3_DEFAULTS, **hf, "rope_parameters": full_rope, "rope_scaling": None}


def _gemma3_layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or (configs older than that field) every ``sliding_window_pattern``-th layer full."""
    num_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(layer_types) - set(GEMMA3_LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types {', '.join(map(repr, unknown))} are not supported (supported: "
                          f"{', '.join(GEMMA3_LAYER_TYPES)})")
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types names {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    return tuple(layer_types)


def gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields: ``(1 + w)`` q/k norms, its attention scale, logit soft-capping, windows and the
    sliding layers' rotary base; variants the model cannot run are refused."""
    text = gemma3_text_config(hf)
    if text["hidden_activation"] != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation {text['hidden_activation']!r} is not supported "
                          "(only gelu_pytorch_tanh)")
    if text.get("attn_logit_softcapping") is not None:
        raise ConfigError("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it null)")
    if text.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported (Quire's attention is causal)")
    _, local_rope = _gemma3_rope(hf)
    local_type = local_rope.get("rope_type") or local_rope.get("type") or "default"
    if local_type != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type {local_type!r} is not supported "
                          "(only default)")
    bias = bool(text.get("attention_bias", False))
    softcap = text.get("final_logit_softcapping")
    return {"qkv_bias": bias, "o_proj_bias": bias, "qk_norm": True,
            "query_pre_attn_scalar": float(text["query_pre_attn_scalar"]),
            "final_logit_softcapping": float(softcap) if softcap is not None else None,
            "local_rope_theta": float(local_rope["rope_theta"]),
            "sliding_window": _window(text.get("sliding_window"), "sliding_window"),
            "layer_types": _gemma3_layer_types(text)}


register_model(ModelEntry("Gemma3ForCausalLM", "quire.core.models.gemma3", "Gemma3ForCausalLM", gemma3_fields,
                          LLAMA_WEIGHTS, model_types=("gemma3_text",), text_config=gemma3_text_config))


# Mixtures of experts: Llama's attention (Qwen3-MoE's with q/k RMSNorm) and a routed sparse MoE block as the
# MLP. transformers 5.x saves one tensor per expert and projection (``experts.<e>.w1`` / ``gate_proj`` …), which
# are stacked into one ``[num_experts, rows, columns]`` parameter per projection; checkpoints already holding
# the stacked ``experts.gate_up_proj`` / ``experts.down_proj`` load as they are. Not split for tensor parallelism.
def _moe_fields(hf: dict[str, Any], num_experts_key: str, moe_intermediate_size: int, norm_topk_prob: bool,
                dense_mlp_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    num_experts = _positive_int(hf.get(num_experts_key), num_experts_key)
    top_k = _positive_int(hf.get("num_experts_per_tok"), "num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds {num_experts_key} {num_experts}")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _positive_int(moe_intermediate_size, "moe_intermediate_size"),
            "norm_topk_prob": norm_topk_prob, "dense_mlp_layers": dense_mlp_layers}


def _positive_int(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{field} must be a positive integer, got {value!r}")
    return value


def mixtral_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: ``num_local_experts`` experts of width ``intermediate_size``, top-k weights always renormalised;
    ``sliding_window`` on every layer where set (MixtralConfig's default is none)."""
    return {**llama_fields(hf), "sliding_window": _window(hf.get("sliding_window"), "sliding_window"),
            **_moe_fields(hf, "num_local_experts", hf.get("intermediate_size"), norm_topk_prob=True)}


def qwen3_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention; ``num_experts`` (``num_local_experts`` as transformers 5.x saves it) experts
    of width ``moe_intermediate_size``, renormalised if ``norm_topk_prob``. Layers in ``mlp_only_layers``, and
    those whose number (from 1) ``decoder_sparse_step`` does not divide, keep a dense MLP of width
    ``intermediate_size``. Missing keys take Qwen3MoeConfig's defaults."""
    num_layers = int(hf["num_hidden_layers"])
    step = _positive_int(hf.get("decoder_sparse_step", 1), "decoder_sparse_step")
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in mlp_only):
        raise ConfigError(f"mlp_only_layers must list layer indices below {num_layers}, got {mlp_only!r}")
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    return {**qwen3_fields(hf), **_moe_fields({key: 128, "num_experts_per_tok": 8, **hf}, key,
                                              hf.get("moe_intermediate_size", 768),
                                              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                                              dense_mlp_layers=dense)}


def _expert_weights(gate: str, up: str, down: str) -> tuple[ExpertWeight, ...]:
    return (ExpertWeight(".mlp.experts.", "gate_up_proj", ((gate, lambda c: c.moe_intermediate_size),
                                                           (up, lambda c: c.moe_intermediate_size))),
            ExpertWeight(".mlp.experts.", "down_proj", ((down, lambda c: c.hidden_size),)))


MIXTRAL_WEIGHTS = dataclasses.replace(LLAMA_WEIGHTS, renamed_parts=((".block_sparse_moe.", ".mlp."),),
                                      experts=_expert_weights("w1.weight", "w3.weight", "w2.weight"))
QWEN3_MOE_WEIGHTS = dataclasses.replace(
    LLAMA_WEIGHTS, experts=_expert_weights("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
_MOE = ("quire.core.models.moe", "MoeForCausalLM")
register_model(ModelEntry("MixtralForCausalLM", *_MOE, mixtral_fields, MIXTRAL_WEIGHTS, model_types=("mixtral",)))
register_model(ModelEntry("Qwen3MoeForCausalLM", *_MOE, qwen3_moe_fields, QWEN3_MOE_WEIGHTS,
                          model_types=("qwen3_moe",)))
