"""``MultiModalProcessor``: the model's Hugging Face processor run in the front end. A prompt's text and
images go in; the prompt's token ids (each image placeholder expanded to the image's tokens, exactly as the
processor expands it) and one ``MultiModalFeature`` per image come out."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from quire.core.config import ModelConfig, MultiModalConfig
from quire.core.errors import ConfigError, ValidationError
from quire.core.multimodal.features import TEXT_KEYS, image_identifier, placeholder_ranges, split_per_image
from quire.core.multimodal.media import MediaLoader
from quire.core.multimodal.parts import ImageInput
from quire.core.wire import MultiModalFeature, TensorData


class MultiModalProcessor:
    """Checks, loads and processes a prompt's images (``process``); the ``Renderer`` calls it for every prompt
    that carries images. ``image_token_id`` is the placeholder token the processor expands."""

    def __init__(self, hf_processor, image_token_id: int, config: MultiModalConfig,
                 processor_kwargs: dict[str, Any] | None = None):
        self.hf_processor = hf_processor
        self.image_token_id = image_token_id
        self.config = config
        self.processor_kwargs = dict(processor_kwargs or {})
        self.media = MediaLoader(config)
        # NOTE: prompts are rendered on several threads; a fast tokenizer refuses concurrent calls that change
        # its settings ("Already borrowed"), so processor calls take turns (loading and downloads do not).
        self._lock = threading.Lock()
        # the placeholder as text (LLaVA's "<image>"), to say early when a prompt has too few or too many
        self.image_token = getattr(hf_processor, "image_token", None)
        image_processor = getattr(hf_processor, "image_processor", None)
        self.merge_size = int(getattr(image_processor, "merge_size", None) or 2)

    @classmethod
    def from_model(cls, model: ModelConfig, config: MultiModalConfig) -> MultiModalProcessor:
        """The processor saved with the checkpoint (``processor_config.json``, ``preprocessor_config.json``)."""
        from transformers import AutoProcessor

        try:
            try:
                hf_processor = AutoProcessor.from_pretrained(model.path)
            except ImportError:
                # NOTE: transformers' Qwen2-VL family processors build a video processor, which needs
                # torchvision even for images; the image processor and the tokenizer do without
                from quire.core.multimodal.grid_processor import GridImageProcessor

                hf_processor = GridImageProcessor.from_pretrained(model.path, model.image_token_id)
                if hf_processor is None:
                    raise
        except (OSError, ValueError, ImportError) as error:
            raise ConfigError(f"the model takes images but its processor could not be loaded: {error}") from None
        if getattr(hf_processor, "image_processor", None) is None:
            raise ConfigError(f"the model takes images but {type(hf_processor).__name__} has no image processor")
        return cls(hf_processor, model.image_token_id, config)

    @property
    def max_images(self) -> int:
        return self.config.limit_per_prompt.get("image", 0)

    def check_count(self, images: list[ImageInput], param: str) -> None:
        """Refuse more images than ``--limit-mm-per-prompt`` allows, before any is loaded."""
        if len(images) > self.max_images:
            raise ValidationError(f"At most {self.max_images} image(s) may be provided in one prompt; this one "
                                  f"has {len(images)}", param=param)

    def process(self, text: str, images: list[ImageInput], add_special_tokens: bool,
                param: str) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids and features of ``text`` with its ``images`` (in placeholder order); ``param`` is the field
        errors about the prompt as a whole name (``prompt`` or ``messages``)."""
        self.check_count(images, param)
        if self.image_token is not None and text.count(self.image_token) != len(images):
            raise ValidationError(f"the prompt holds {text.count(self.image_token)} {self.image_token} "
                                  f"placeholder(s) for {len(images)} image(s)", param=param)
        loaded = [self.media.load(image) for image in images]
        try:
            with self._lock:
                outputs = self.hf_processor(text=[text], images=loaded, return_tensors="np",
                                            add_special_tokens=add_special_tokens, **self.processor_kwargs)
        except (ValueError, TypeError, OSError) as error:
            raise ValidationError(f"the model's processor refused the prompt's images: {error}",
                                  param=param) from None
        token_ids = np.asarray(outputs["input_ids"])[0].tolist()
        tensors = {name: np.asarray(value) for name, value in outputs.items() if name not in TEXT_KEYS}
        per_image, lengths = split_per_image(tensors, len(loaded), self.merge_size)
        if lengths is None:
            lengths = self._placeholder_lengths(loaded)
        try:
            ranges = placeholder_ranges(token_ids, self.image_token_id, len(loaded), lengths)
        except ValueError as error:
            raise ValidationError(str(error), param=param) from None
        features = [
            MultiModalFeature("image", image_identifier(image, self.processor_kwargs), offset, length,
                              {name: TensorData.from_array(value) for name, value in data.items()})
            for image, (offset, length), data in zip(loaded, ranges, per_image)]
        return token_ids, features

    def _placeholder_lengths(self, images) -> list[int] | None:
        """Each image's number of placeholder tokens as the processor computes it (transformers' hook for
        serving engines); None where the processor does not say, and the runs of placeholders decide."""
        count = getattr(self.hf_processor, "_get_num_multimodal_tokens", None)
        if count is None:
            return None
        try:
            lengths = count(image_sizes=[(image.height, image.width) for image in images])["num_image_tokens"]
        except (AttributeError, KeyError, TypeError, ValueError, NotImplementedError):
            return None
        return None if lengths is None else [int(length) for length in lengths]
