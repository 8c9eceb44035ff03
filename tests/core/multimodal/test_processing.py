"""The front end's image processing on the tiny LLaVA checkpoint: prompt token ids and per-image
``pixel_values`` equal what Hugging Face's processor gives for the same text and images, placeholder ranges
and identifiers are right, and malformed prompts are refused naming the field (before any image is loaded)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from quire.core.config import MultiModalConfig
from quire.core.errors import ValidationError
from quire.core.multimodal.parts import ImageInput
from quire.core.multimodal.processing import MultiModalProcessor
from quire.core.renderer import ChatPrompt, Renderer
from quire.core.testing.multimodal_checkpoints import IMAGE_TOKEN
from quire.core.testing.multimodal_checkpoints import sample_image as make_image

NUM_IMAGE_TOKENS = 16  # (32 / 8) ** 2 patches of the tiny CLIP


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


@pytest.fixture(scope="module")
def hf_processor(llava_checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava_checkpoint)


@pytest.fixture(scope="module")
def image_token_id(hf_processor):
    return hf_processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def make_renderer(hf_processor, image_token_id, **config) -> Renderer:
    processor = MultiModalProcessor(hf_processor, image_token_id, MultiModalConfig(**config))
    return Renderer(hf_processor.tokenizer, len(hf_processor.tokenizer), processor)


@pytest.fixture(scope="module")
def renderer(hf_processor, image_token_id):
    return make_renderer(hf_processor, image_token_id)


def refusal(renderer, prompt) -> ValidationError:
    with pytest.raises(ValidationError) as error:
        renderer.render(prompt)
    return error.value


def test_a_prompt_with_images_matches_the_hf_processor(renderer, hf_processor, image_token_id):
    images = [make_image(40, 30, seed=1), make_image(25, 50, seed=2)]
    text = f"{IMAGE_TOKEN}\nWhat is this? And this: {IMAGE_TOKEN} compared?"
    rendered = renderer.render({"prompt": text, "multi_modal_data": {"image": images}})
    expected = hf_processor(text=text, images=images, return_tensors="np")
    assert rendered.token_ids == expected["input_ids"][0].tolist()
    assert rendered.text == text
    assert len(rendered.mm_features) == 2
    for index, feature in enumerate(rendered.mm_features):
        assert feature.modality == "image" and feature.length == NUM_IMAGE_TOKENS
        span = rendered.token_ids[feature.offset:feature.offset + feature.length]
        assert span == [image_token_id] * NUM_IMAGE_TOKENS
        assert rendered.token_ids[feature.offset - 1] != image_token_id
        assert rendered.token_ids[feature.offset + feature.length] != image_token_id
        pixel_values = feature.data["pixel_values"].to_array()
        assert pixel_values.shape == (1, 3, 32, 32) and pixel_values.dtype == np.float32
        np.testing.assert_array_equal(pixel_values, expected["pixel_values"][index:index + 1])
    assert rendered.mm_features[0].offset < rendered.mm_features[1].offset
    assert rendered.mm_features[0].identifier != rendered.mm_features[1].identifier


def test_add_special_tokens_is_honoured(renderer, hf_processor):
    image = make_image(32, 32)
    text = f"{IMAGE_TOKEN} caption:"
    for add_special_tokens in (True, False):
        rendered = renderer.render({"prompt": text, "add_special_tokens": add_special_tokens,
                                    "multi_modal_data": {"image": image}})
        expected = hf_processor(text=text, images=[image], add_special_tokens=add_special_tokens)
        assert rendered.token_ids == list(expected["input_ids"][0])


def test_a_chat_with_image_parts_matches_the_hf_chat_template_and_processor(renderer, hf_processor):
    image = make_image(48, 36, seed=5)
    messages = [{"role": "system", "content": "You describe pictures."},
                {"role": "user", "content": [image_part(image), {"type": "text", "text": "What is in it?"}]}]
    rendered = renderer.render(ChatPrompt(messages))
    hf_messages = [messages[0], {"role": "user", "content": [{"type": "image", "image": image},
                                                             {"type": "text", "text": "What is in it?"}]}]
    expected = hf_processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True, return_tensors="np")
    assert rendered.text.count(IMAGE_TOKEN) == 1 and rendered.is_chat
    assert rendered.token_ids == expected["input_ids"][0].tolist()
    np.testing.assert_array_equal(rendered.mm_features[0].data["pixel_values"].to_array(), expected["pixel_values"])


def test_text_parts_stay_parts_for_a_model_that_takes_images(renderer, hf_processor):
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    rendered = renderer.render(ChatPrompt(messages))
    assert rendered.text == hf_processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False)
    assert "onetwo" in rendered.text and rendered.mm_features is None


def test_adjacent_images_get_one_range_each(renderer, image_token_id):
    images = [make_image(30, 30, seed=1), make_image(30, 30, seed=1), make_image(20, 40, seed=9)]
    rendered = renderer.render({"prompt": f"look:{IMAGE_TOKEN * 3} ok", "multi_modal_data": {"image": images}})
    offsets = [feature.offset for feature in rendered.mm_features]
    assert offsets[1] == offsets[0] + NUM_IMAGE_TOKENS and offsets[2] == offsets[1] + NUM_IMAGE_TOKENS
    assert rendered.token_ids.count(image_token_id) == 3 * NUM_IMAGE_TOKENS
    first, second, third = (feature.identifier for feature in rendered.mm_features)
    assert first == second != third  # the same image twice has one identifier


def test_the_same_pixels_have_the_same_identifier_however_they_arrive(renderer):
    image = make_image(40, 30, seed=4)
    as_pil = renderer.render({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": image}})
    as_url = renderer.render(ChatPrompt([{"role": "user", "content": [image_part(image)]}]))
    as_offline_part = renderer.render(ChatPrompt([{"role": "user", "content": [{"type": "image_pil",
                                                                               "image_pil": image}]}]))
    assert as_pil.mm_features[0].identifier == as_url.mm_features[0].identifier
    assert as_url.token_ids == as_offline_part.token_ids
    assert as_url.mm_features == as_offline_part.mm_features


@pytest.mark.parametrize("prompt,param,words", [
    ({"prompt": f"{IMAGE_TOKEN} and {IMAGE_TOKEN}", "multi_modal_data": {"image": [make_image(8, 8)]}},
     "prompt", "2 <image> placeholder(s) for 1 image"),
    ({"prompt": "no placeholder", "multi_modal_data": {"image": make_image(8, 8)}}, "prompt", "0 <image>"),
    ({"prompt": f"stray {IMAGE_TOKEN}"}, "prompt", "no image"),
    ({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": make_image(8, 8)}}, "multi_modal_data",
     "text prompt"),
    ({"prompt": IMAGE_TOKEN, "multi_modal_data": {"video": [1]}}, "multi_modal_data.video", "only 'image'"),
    ({"prompt": IMAGE_TOKEN, "multi_modal_data": [make_image(8, 8)]}, "multi_modal_data", "dict"),
    ({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": ["not a url"]}}, "multi_modal_data.image[0]", "url"),
    (ChatPrompt([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].image_url.url", "non-empty"),
    (ChatPrompt([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio_url"}]}]),
     "messages[0].content[1]", "text or image"),
    (ChatPrompt([{"role": "user", "content": [{"type": "image_url",
                                               "image_url": {"url": "data:image/png;base64,@@"}}]}]),
     "messages[0].content[0].image_url.url", "base64"),
    (ChatPrompt([{"role": "user", "content": f"{IMAGE_TOKEN} typed by hand"}]), "messages", "no image"),
])
def test_malformed_prompts_are_refused_naming_the_field(renderer, prompt, param, words):
    error = refusal(renderer, prompt)
    assert error.param == param, (error.param, error.message)
    assert words.lower() in error.message.lower(), error.message


def test_the_image_limit_is_checked_before_any_image_is_loaded(hf_processor, image_token_id):
    renderer = make_renderer(hf_processor, image_token_id, limit_per_prompt={"image": 2})
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}  # would fail to load
    error = refusal(renderer, ChatPrompt([{"role": "user", "content": [broken] * 3}]))
    assert error.param == "messages" and "At most 2 image(s)" in error.message
    error = refusal(renderer, {"prompt": IMAGE_TOKEN * 3, "multi_modal_data": {"image": ["data:,"] * 3}})
    assert error.param == "multi_modal_data" and "At most 2 image(s)" in error.message
    assert len(renderer.render({"prompt": IMAGE_TOKEN * 2,
                                "multi_modal_data": {"image": [make_image(8, 8)] * 2}}).mm_features) == 2


def test_a_text_only_model_refuses_images(hf_processor):
    text_only = Renderer(hf_processor.tokenizer, len(hf_processor.tokenizer))
    error = refusal(text_only, ChatPrompt([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                        image_part(make_image(8, 8))]}]))
    assert error.param == "messages[0].content[1]" and "text only" in error.message
    error = refusal(text_only, {"prompt": "hi", "multi_modal_data": {"image": make_image(8, 8)}})
    assert error.param == "multi_modal_data.image" and "text only" in error.message
    # text parts are still joined, as before images existed
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert "one\ntwo" in text_only.render(ChatPrompt([{"role": "user", "content": parts}])).text


def test_processing_never_passes_urls_to_the_hf_processor(hf_processor, image_token_id):
    """transformers' processors download URL strings themselves: only decoded images may reach them."""
    seen = []

    def recording(*args, **kwargs):
        seen.extend(kwargs["images"])
        return hf_processor(*args, **kwargs)

    processor = MultiModalProcessor(recording, image_token_id, MultiModalConfig())
    processor.image_token = IMAGE_TOKEN
    processor.process(IMAGE_TOKEN, [ImageInput(data_url(make_image(8, 8)), "x")], True, "prompt")
    from PIL import Image

    assert len(seen) == 1 and isinstance(seen[0], Image.Image)
