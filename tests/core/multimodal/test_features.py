"""Splitting a processor's batched outputs per image, placeholder ranges and image identifiers, on synthetic
arrays (no checkpoint)."""

import numpy as np
import pytest
from PIL import Image

from quire.core.multimodal.features import image_identifier, placeholder_ranges, split_per_image
from quire.core.testing.multimodal_checkpoints import sample_image as make_image

IMG = 7  # the image placeholder token id of these tests


def test_llava_style_tensors_are_sliced_by_their_first_dimension():
    pixel_values = np.arange(3 * 3 * 4 * 4, dtype=np.float32).reshape(3, 3, 4, 4)
    image_sizes = np.array([[10, 20], [30, 40], [50, 60]])
    items, lengths = split_per_image({"pixel_values": pixel_values, "image_sizes": image_sizes}, 3)
    assert lengths is None
    for i, item in enumerate(items):
        assert item["pixel_values"].shape == (1, 3, 4, 4)
        np.testing.assert_array_equal(item["pixel_values"][0], pixel_values[i])
        np.testing.assert_array_equal(item["image_sizes"], image_sizes[i:i + 1])


def test_qwen2_vl_style_rows_are_split_by_the_grid():
    grid = np.array([[1, 4, 6], [1, 2, 2], [2, 2, 4]])  # 24, 4 and 16 patch rows
    pixel_values = np.arange(44 * 5, dtype=np.float32).reshape(44, 5)
    items, lengths = split_per_image({"pixel_values": pixel_values, "image_grid_thw": grid}, 3, merge_size=2)
    assert lengths == [6, 1, 4]
    assert [item["pixel_values"].shape[0] for item in items] == [24, 4, 16]
    np.testing.assert_array_equal(np.concatenate([item["pixel_values"] for item in items]), pixel_values)
    np.testing.assert_array_equal(items[2]["pixel_values"], pixel_values[28:44])
    for i, item in enumerate(items):
        np.testing.assert_array_equal(item["image_grid_thw"], grid[i:i + 1])
    _, merged_by_one = split_per_image({"pixel_values": pixel_values, "image_grid_thw": grid}, 3, merge_size=1)
    assert merged_by_one == [24, 4, 16]


def test_a_tensor_that_fits_no_layout_is_refused():
    with pytest.raises(ValueError, match="pixel_values"):
        split_per_image({"pixel_values": np.zeros((5, 3))}, 2)
    with pytest.raises(ValueError, match="image_grid_thw"):
        split_per_image({"pixel_values": np.zeros((8, 3)), "image_grid_thw": np.array([[1, 2, 4]])}, 2)


def test_each_run_of_placeholders_is_one_image():
    ids = [1, IMG, IMG, IMG, 2, 3, IMG, IMG, IMG, 4]
    assert placeholder_ranges(ids, IMG, 2) == [(1, 3), (6, 3)]
    with pytest.raises(ValueError, match="2 image placeholder"):
        placeholder_ranges(ids, IMG, 3)
    with pytest.raises(ValueError, match="0 image placeholder"):
        placeholder_ranges([1, 2, 3], IMG, 1)


def test_known_lengths_tell_adjacent_images_apart():
    ids = [1] + [IMG] * 7 + [2] + [IMG] * 2
    assert placeholder_ranges(ids, IMG, 3, [4, 3, 2]) == [(1, 4), (5, 3), (9, 2)]
    with pytest.raises(ValueError, match="line up"):
        placeholder_ranges(ids, IMG, 3, [4, 4, 1])  # the second image would span the text token
    with pytest.raises(ValueError, match="need"):
        placeholder_ranges(ids, IMG, 3, [4, 3, 3])


def test_the_identifier_follows_the_pixels():
    first, second = make_image(24, 16, seed=1), make_image(24, 16, seed=2)
    assert image_identifier(first) == image_identifier(make_image(24, 16, seed=1))
    assert image_identifier(first) == image_identifier(first.copy())
    assert image_identifier(first) != image_identifier(second)
    assert len(image_identifier(first)) == 64 and int(image_identifier(first), 16) >= 0
    # one pixel changed
    changed = first.copy()
    changed.putpixel((3, 3), tuple((c + 1) % 256 for c in first.getpixel((3, 3))))
    assert image_identifier(changed) != image_identifier(first)
    # the same bytes with another shape, or in another mode, are another image
    assert image_identifier(first) != image_identifier(Image.frombytes("RGB", (16, 24), first.tobytes()))
    assert image_identifier(first) != image_identifier(Image.frombytes("L", (72, 16), first.tobytes()))
    # processing options are part of it
    assert image_identifier(first, {"size": 32}) != image_identifier(first)


def test_palette_images_with_the_same_indices_but_other_colours_differ():
    indices = bytes(range(16)) * 4
    red = Image.frombytes("P", (8, 8), indices)
    red.putpalette([255, 0, 0] * 256)
    blue = Image.frombytes("P", (8, 8), indices)
    blue.putpalette([0, 0, 255] * 256)
    assert red.tobytes() == blue.tobytes()
    assert image_identifier(red) != image_identifier(blue)
