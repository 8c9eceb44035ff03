"""Build small vision-language checkpoints (LLaVA-1.5 and Qwen2.5-VL) with a fixed seed, and test images.

The language model is shaped and scaled like ``quire.core.testing.checkpoints`` (peaked logits); the
vision tower (a small CLIP, or Qwen2.5-VL's windowed transformer) has random weights. The folder holds
everything a user's download holds: config, safetensors, tokenizer with the image tokens, chat template that
places image parts, and the processor's configuration, so ``AutoProcessor.from_pretrained(folder)`` works
(for Qwen2.5-VL only where torchvision is installed; ``AutoImageProcessor`` and ``AutoTokenizer`` work anywhere).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from quire.core.testing.checkpoints import TinyModelSpec, _rescale, _write_json, build_tokenizer

IMAGE_TOKEN = "<image>"
# ChatML whose content may be a list of text and image parts (the shape Hugging Face processors render).
MULTIMODAL_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyVisionSpec:
    """The CLIP vision tower of a tiny LLaVA checkpoint: ``image_size / patch_size`` squared patches."""

    image_size: int = 32
    patch_size: int = 8
    hidden_size: int = 48
    intermediate_size: int = 96
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"  # drop the CLS token


def build_llava_checkpoint(folder: str | Path, text: TinyModelSpec | None = None,
                           vision: TinyVisionSpec | None = None) -> Path:
    """Write a ``LlavaForConditionalGeneration`` checkpoint and its ``LlavaProcessor`` into ``folder``."""
    import torch
    from transformers import (
        AutoConfig,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    folder = Path(folder)
    text = text or TinyModelSpec(model_type="llama", logit_std=6.0, seed=11)
    vision = vision or TinyVisionSpec()
    tokenizer = build_tokenizer(text.vocab_size)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = MULTIMODAL_CHATML_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_config = AutoConfig.for_model(
        text.model_type, vocab_size=max(text.vocab_size, len(tokenizer)), hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size, num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        max_position_embeddings=text.max_position_embeddings, tie_word_embeddings=False,
        initializer_range=text.init_std, rope_theta=text.rope_theta, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=eos_id)
    vision_config = CLIPVisionConfig(
        hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
        num_hidden_layers=vision.num_hidden_layers, num_attention_heads=vision.num_attention_heads,
        image_size=vision.image_size, patch_size=vision.patch_size, projection_dim=vision.hidden_size)
    num_patches = (vision.image_size // vision.patch_size) ** 2
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
                         projector_hidden_act="gelu", vision_feature_layer=vision.vision_feature_layer,
                         vision_feature_select_strategy=vision.vision_feature_select_strategy,
                         image_seq_length=num_patches, tie_word_embeddings=False)
    torch.manual_seed(text.seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    _rescale(model, text)
    with torch.no_grad():  # image features on the scale of the token embeddings
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith("weight"):
                param.normal_(0.0, text.init_std)
    model.to(getattr(torch, text.dtype))
    model.save_pretrained(folder)
    image_processor = _clip_image_processor_class()(
        size={"shortest_edge": vision.image_size}, crop_size={"height": vision.image_size, "width": vision.image_size},
        do_center_crop=True, do_resize=True, do_normalize=True, do_convert_rgb=True)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
                               vision_feature_select_strategy=vision.vision_feature_select_strategy,
                               chat_template=MULTIMODAL_CHATML_TEMPLATE, image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1)
    processor.save_pretrained(folder)
    _write_json(folder / "generation_config.json", {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False})
    return folder


# The normalisation Qwen2-VL's image processor takes from OpenAI's CLIP.
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The multimodal ChatML above, with Qwen2-VL's image part: the processor expands ``<|image_pad|>`` to one token
# per merged patch of the image.
QWEN_VL_CHATML_TEMPLATE = MULTIMODAL_CHATML_TEMPLATE.replace(
    "{{ '<image>' }}", "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}")


@dataclasses.dataclass(frozen=True)
class TinyQwenVisionSpec:
    """The vision side of a tiny Qwen2.5-VL checkpoint, and its processor's pixel bounds.

    Patches of ``patch_size`` pixels are merged ``spatial_merge_size`` squared into one token; windows span
    ``window_size`` pixels (here 2x2 merged tokens), and only ``fullatt_block_indexes`` attend to the whole
    image. ``mrope_section`` splits the language model's rotary frequencies over (t, h, w).
    """

    depth: int = 4
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    patch_size: int = 8
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 32
    fullatt_block_indexes: tuple[int, ...] = (1, 3)
    min_pixels: int = 32 * 32
    max_pixels: int = 80 * 80
    mrope_section: tuple[int, int, int] = (2, 3, 3)


def build_qwen2_5_vl_checkpoint(folder: str | Path, text: TinyModelSpec | None = None,
                                vision: TinyQwenVisionSpec | None = None) -> Path:
    """Write a ``Qwen2_5_VLForConditionalGeneration`` checkpoint and its ``Qwen2_5_VLProcessor``'s files (a
    Qwen2-VL image processor, the tokenizer with the vision tokens, the chat template) into ``folder``."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    text = text or TinyModelSpec(model_type="qwen2", logit_std=6.0, seed=12)
    vision = vision or TinyQwenVisionSpec()
    tokenizer = build_tokenizer(text.vocab_size)
    tokenizer.add_tokens(list(QWEN_VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = QWEN_VL_CHATML_TEMPLATE
    token_ids = dict(zip(QWEN_VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))))
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_config = {
        "vocab_size": max(text.vocab_size, len(tokenizer)), "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size, "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads, "num_key_value_heads": text.num_key_value_heads,
        "max_position_embeddings": text.max_position_embeddings, "initializer_range": text.init_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta,
                            "mrope_section": list(vision.mrope_section)},
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id}
    vision_config = {
        "depth": vision.depth, "hidden_size": vision.hidden_size, "intermediate_size": vision.intermediate_size,
        "num_heads": vision.num_heads, "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size, "spatial_merge_size": vision.spatial_merge_size,
        "window_size": vision.window_size, "fullatt_block_indexes": list(vision.fullatt_block_indexes),
        "out_hidden_size": text.hidden_size, "initializer_range": text.init_std}
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"], vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(text.seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    _rescale(model, text)  # the vision tower is initialised at the same scale (its initializer_range)
    model.to(getattr(torch, text.dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # NOTE: the processor's files written as the Hub's checkpoints have them: transformers 5's Qwen2_5_VLProcessor
    # cannot be built (nor loaded by AutoProcessor) without torchvision, which its video processor needs.
    _write_json(folder / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": vision.min_pixels, "max_pixels": vision.max_pixels, "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size, "merge_size": vision.spatial_merge_size,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True,
        "resample": 3})
    _write_json(folder / "generation_config.json", {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False})
    return folder


def sample_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB ``PIL.Image`` of the given size (smooth gradients plus seeded noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1),
                     (x + y) * 127 / max(width + height - 2, 1)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, size=base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def _clip_image_processor_class():
    """transformers 5's PIL-based CLIP image processor (the default one needs torchvision), else 4.x's."""
    try:
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    except ImportError:
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor

