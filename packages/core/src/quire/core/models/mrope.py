"""Multimodal rotary positions (M-RoPE, Qwen2-VL family) of a prompt: three rows (t, h, w) per token.

Torch-free (numpy only), so input preparation can compute them wherever it runs. Text tokens advance one
position on all three rows at once; an image's tokens share its first position on the t row and spread over
its merged grid on the h and w rows; the text after an image resumes past the image's larger side::

    tokens:  a  b  [img 2 x 3 merged]      c
    t:       0  1  2  2  2  2  2  2        5
    h:       0  1  2  2  2  3  3  3        5
    w:       0  1  2  3  4  2  3  4        5
"""

from __future__ import annotations

import numpy as np


def mrope_positions(token_ids: list[int], image_grids: list[tuple[int, int, int]], image_token_id: int,
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """``[3, len(token_ids)]`` int64 positions of a prompt whose runs of ``image_token_id`` hold the images of
    ``image_grids`` (each image's patch grid (t, h, w), ``image_grid_thw``) in order, as transformers'
    ``get_rope_index`` computes them; and the delta such that a token at sequence index ``p >= len(token_ids)``
    has position ``p + delta`` on every row.

    Each image takes ``t * h * w / spatial_merge_size**2`` placeholder tokens, so images side by side (one
    run) are told apart. Raises ``ValueError`` when the placeholders do not match the grids.
    """
    num_tokens = len(token_ids)
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = next_position = 0  # next token index to fill, and the position it starts at
    for offset, grid in zip(_image_offsets(token_ids, image_grids, image_token_id, spatial_merge_size), image_grids):
        t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
        positions[:, cursor:offset] = next_position + np.arange(offset - cursor)
        next_position += offset - cursor
        end = offset + t * h * w
        positions[:, offset:end] = next_position + np.stack(
            [axis.ravel() for axis in np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")])
        next_position += max(h, w)
        cursor = end
    positions[:, cursor:] = next_position + np.arange(num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def _image_offsets(token_ids: list[int], image_grids: list[tuple[int, int, int]], image_token_id: int,
                   spatial_merge_size: int) -> list[int]:
    """Where each image's placeholder tokens start."""
    ids = np.asarray(token_ids, dtype=np.int64)
    is_image = ids == image_token_id
    lengths = []
    for t, h, w in image_grids:
        if min(t, h, w) < 1 or h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"image grid {(t, h, w)} does not divide into {spatial_merge_size}-patch merge blocks")
        lengths.append(t * h * w // spatial_merge_size**2)
    if int(is_image.sum()) != sum(lengths):
        raise ValueError(f"the prompt holds {int(is_image.sum())} image placeholder tokens; its "
                         f"{len(image_grids)} image(s) need {sum(lengths)}")
    placeholders = np.flatnonzero(is_image)
    starts = np.cumsum([0, *lengths[:-1]]).astype(np.int64)
    offsets = placeholders[starts].tolist() if lengths else []
    for offset, length in zip(offsets, lengths):
        if not is_image[offset:offset + length].all() or offset + length > len(ids):
            raise ValueError("the image placeholders of the prompt do not line up with its images")
    return offsets
