"""Images as callers give them: image parts of chat messages and ``multi_modal_data`` of prompt dicts, checked
for shape only (no image library is imported here; loading is ``media``'s job)."""

from __future__ import annotations

import dataclasses
from typing import Any

from quire.core.errors import ValidationError

# OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` and vLLM's offline ``{"type": "image_pil",
# "image_pil": <PIL.Image>}``.
IMAGE_PART_TYPES = ("image_url", "image_pil")


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One image of a prompt before loading: a URL (``data:``, ``file://``, ``http(s)://``) or an in-memory
    image (a ``PIL.Image.Image``), and ``param``, the field it came from (what errors name)."""

    source: Any
    param: str


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def image_from_part(part: dict[str, Any], param: str) -> ImageInput:
    """The image of an ``image_url`` or ``image_pil`` content part (``param`` names the part)."""
    if part["type"] == "image_pil":
        if part.get("image_pil") is None:
            raise ValidationError(f"{param}.image_pil must be an image", param=f"{param}.image_pil")
        return ImageInput(part["image_pil"], f"{param}.image_pil")
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise ValidationError(f"{param}.image_url.url must be a non-empty string (a data: or http(s) URL)",
                              param=f"{param}.image_url.url")
    return ImageInput(url, f"{param}.image_url.url")


def images_from_multi_modal_data(data: Any, param: str = "multi_modal_data") -> list[ImageInput]:
    """``{"image": image_or_list}`` (an image is a ``PIL.Image.Image`` or a URL string) as a list."""
    if not isinstance(data, dict):
        raise ValidationError(f"{param} must be a dict such as {{'image': [image, ...]}}", param=param)
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValidationError(f"{param} holds {unknown}; only 'image' is supported", param=f"{param}.{unknown[0]}")
    images = data.get("image")
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [ImageInput(image, f"{param}.image[{i}]") for i, image in enumerate(images)]
    return [ImageInput(images, f"{param}.image")]
