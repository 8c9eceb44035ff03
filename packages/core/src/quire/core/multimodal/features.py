"""From a processor's batched outputs to one entry per image: splitting the tensors, finding each image's
placeholder tokens in the prompt, and the identifier of an image's content."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

# Processor outputs about the text, not the images.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                       "text_replacement_offsets"})


def split_per_image(outputs: dict[str, np.ndarray], num_images: int,
                    merge_size: int = 2) -> tuple[list[dict[str, np.ndarray]], list[int] | None]:
    """Split batched image tensors into ``num_images`` dicts; also return each image's number of placeholder
    tokens when the outputs say it (None otherwise).

    A tensor whose first dimension is ``num_images`` is sliced ``[i:i+1]`` (LLaVA's ``pixel_values``). With
    ``image_grid_thw`` (``[num_images, 3]``, Qwen2-VL style), tensors with one row per patch are split into
    ``t*h*w`` rows per image, and image ``i`` has ``t*h*w // merge_size**2`` placeholder tokens.
    Raises ``ValueError`` for a tensor that fits neither layout.
    """
    bounds = lengths = None
    grid = outputs.get("image_grid_thw")
    if grid is not None:
        grid = np.asarray(grid)
        if grid.shape != (num_images, 3):
            raise ValueError(f"image_grid_thw has shape {grid.shape}, expected ({num_images}, 3)")
        rows = [int(np.prod(row)) for row in grid]
        bounds = np.concatenate([[0], np.cumsum(rows)]).tolist()
        lengths = [num_rows // merge_size**2 for num_rows in rows]
    items: list[dict[str, np.ndarray]] = [{} for _ in range(num_images)]
    for name, value in outputs.items():
        value = np.asarray(value)
        first = value.shape[0] if value.ndim else None
        if name == "image_grid_thw" or (first == num_images and (bounds is None or first != bounds[-1])):
            pieces = [value[i:i + 1] for i in range(num_images)]
        elif bounds is not None and first == bounds[-1]:
            pieces = [value[bounds[i]:bounds[i + 1]] for i in range(num_images)]
        else:
            raise ValueError(f"cannot split the processor's {name!r} (shape {value.shape}) over {num_images} images")
        for item, piece in zip(items, pieces):
            item[name] = piece
    return items, lengths


def placeholder_ranges(token_ids: list[int], token_id: int, num_images: int,
                       lengths: list[int] | None = None) -> list[tuple[int, int]]:
    """``(offset, length)`` of each image's placeholder tokens in ``token_ids``, in order.

    Without ``lengths`` each run of ``token_id`` is one image, so there must be ``num_images`` runs. With
    ``lengths`` (placeholder tokens per image), images take consecutive pieces of the runs, so images placed
    side by side (one run) are told apart. Raises ``ValueError`` when the prompt does not match the images.
    """
    runs = _runs(token_ids, token_id)
    if lengths is None:
        if len(runs) != num_images:
            raise ValueError(f"the prompt holds {len(runs)} image placeholder(s) for {num_images} image(s)")
        return runs
    expected, found = sum(lengths), sum(length for _, length in runs)
    if len(lengths) != num_images or expected != found:
        raise ValueError(f"the prompt holds {found} image placeholder tokens; its {num_images} image(s) need "
                         f"{expected}")
    ranges, pending = [], list(runs)
    start, left = pending.pop(0) if pending else (0, 0)
    for length in lengths:
        if left == 0 and pending:
            start, left = pending.pop(0)
        if length > left:
            raise ValueError("the image placeholders of the prompt do not line up with its images")
        ranges.append((start, length))
        start, left = start + length, left - length
    return ranges


def image_identifier(image: Any, processor_kwargs: dict[str, Any] | None = None) -> str:
    """Hex SHA-256 of a decoded ``PIL.Image``'s pixels (mode, size, palette, transparency, data) and the
    processing options: equal for the same image, different for different ones."""
    digest = hashlib.sha256(b"quire-image-v1\0")
    digest.update(json.dumps(processor_kwargs or {}, sort_keys=True, default=str).encode())
    digest.update(f"\0{image.mode}\0{image.width}x{image.height}\0".encode())
    if image.mode in ("P", "PA"):
        digest.update(bytes(image.getpalette() or []))
        digest.update(repr(image.info.get("transparency")).encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs
