"""A stand-in for the Hugging Face processor of the Qwen2-VL family where transformers cannot build it.

transformers' ``Qwen2_5_VLProcessor`` also builds a video processor, and every video processor needs
torchvision, even for prompts without video. Images need only the image processor and the tokenizer: the
image processor gives each image's patches and ``image_grid_thw``, and each placeholder token of the text
becomes ``t * h * w / merge_size**2`` copies of itself, as the processor expands it.
"""

from __future__ import annotations

import numpy as np


class GridImageProcessor:
    """Called like a Hugging Face processor (``processor(text=[text], images=..., add_special_tokens=...)``),
    for images only; ``image_token`` is the placeholder as text (``<|image_pad|>``)."""

    def __init__(self, image_processor, tokenizer, image_token: str):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token

    @classmethod
    def from_pretrained(cls, path: str, image_token_id: int) -> GridImageProcessor | None:
        """The folder's image processor and tokenizer, or None when its image processor gives no patch grid."""
        from transformers import AutoImageProcessor, AutoTokenizer

        image_processor = AutoImageProcessor.from_pretrained(path)
        if getattr(image_processor, "merge_size", None) is None:
            return None
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(image_processor, tokenizer, tokenizer.convert_ids_to_tokens(image_token_id))

    def __call__(self, text: list[str], images: list, return_tensors: str = "np", add_special_tokens: bool = True,
                 **kwargs) -> dict[str, np.ndarray]:
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the text holds {len(pieces) - 1} {self.image_token} placeholder(s) for "
                             f"{len(images)} image(s)")
        outputs = self.image_processor(images=images, return_tensors="np", **kwargs)
        grids = np.asarray(outputs["image_grid_thw"])
        merge = int(self.image_processor.merge_size)
        expanded = pieces[0] + "".join(self.image_token * (int(np.prod(grid)) // merge**2) + piece
                                       for grid, piece in zip(grids, pieces[1:]))
        token_ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": np.asarray([token_ids]), "pixel_values": np.asarray(outputs["pixel_values"]),
                "image_grid_thw": grids}
