"""Images reach the ``EngineCoreRequest`` through the front end (``FrontEnd.process``: the path of the offline
``LLM`` and of the server): each image's tensors, placeholder range and identifier in ``mm_features``, which
cross the process boundary as raw buffers. Also the image options, from ``EngineArgs`` to the config."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from quire.core.config import EngineConfig
from quire.core.engine.front_end import FrontEnd
from quire.core.engine_args import EngineArgs, parse_modality_limits, parse_name_list
from quire.core.errors import ConfigError, ValidationError
from quire.core.renderer import ChatPrompt
from quire.core.sampling_params import SamplingParams
from quire.core.testing.multimodal_checkpoints import IMAGE_TOKEN
from quire.core.testing.multimodal_checkpoints import sample_image as make_image
from quire.core.wire import EngineCoreRequest

PROMPT = f"A picture: {IMAGE_TOKEN}\nDescribe it in a few words, please."


@pytest.fixture(scope="module")
def config(llava_checkpoint) -> EngineConfig:
    return EngineArgs(model=str(llava_checkpoint), dtype="float32", limit_mm_per_prompt={"image": 3},
                      max_image_pixels=100_000).create_engine_config()


@pytest.fixture(scope="module")
def front_end(config):
    return FrontEnd(config, config.model.max_model_len)


@pytest.fixture(scope="module")
def hf_processor(llava_checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava_checkpoint)


def process(front_end, prompt, **params):
    request, _ = front_end.process("r", prompt, SamplingParams(max_tokens=4, **params), None, 0, None)
    return request


def test_the_model_config_says_which_token_is_the_placeholder(config, hf_processor):
    assert config.model.is_multimodal
    assert config.model.image_token_id == hf_processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert config.multimodal.limit_per_prompt == {"image": 3}


def test_an_offline_generate_prompt_becomes_a_request_with_features(front_end, config, hf_processor):
    image = make_image(50, 40, seed=7)
    request = process(front_end, {"prompt": PROMPT, "multi_modal_data": {"image": image}})
    expected = hf_processor(text=PROMPT, images=[image], return_tensors="np")
    assert request.prompt_token_ids == expected["input_ids"][0].tolist()
    [feature] = request.mm_features
    assert request.prompt_token_ids[feature.offset:feature.offset + feature.length] == \
        [config.model.image_token_id] * feature.length
    assert feature.length == 16
    np.testing.assert_array_equal(feature.data["pixel_values"].to_array(), expected["pixel_values"])
    assert process(front_end, "no images here").mm_features is None


def test_offline_chat_image_parts_give_the_same_request_as_urls(front_end):
    import base64
    import io

    image = make_image(30, 60, seed=8)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    question = {"type": "text", "text": "What?"}
    pil_part = {"type": "image_pil", "image_pil": image}
    url_part = {"type": "image_url", "image_url": {"url": url}}
    as_pil = process(front_end, ChatPrompt([{"role": "user", "content": [pil_part, question]}]))
    as_url = process(front_end, ChatPrompt([{"role": "user", "content": [url_part, question]}]))
    assert as_pil.prompt_token_ids == as_url.prompt_token_ids and as_pil.mm_features == as_url.mm_features


def test_features_cross_the_process_boundary_as_raw_buffers(front_end):
    request = process(front_end, {"prompt": PROMPT + IMAGE_TOKEN,
                                  "multi_modal_data": {"image": [make_image(32, 32, 1), make_image(64, 16, 2)]}})
    encoded = msgspec.msgpack.Encoder().encode(request)
    decoded = msgspec.msgpack.decode(encoded, type=EngineCoreRequest)
    assert decoded == request
    for sent, received in zip(request.mm_features, decoded.mm_features):
        np.testing.assert_array_equal(sent.data["pixel_values"].to_array(), received.data["pixel_values"].to_array())
        assert received.data["pixel_values"].to_array().dtype == np.float32
    assert request.mm_features[1].data["pixel_values"].buffer in encoded  # the float32 bytes as they are


def test_truncation_moves_the_placeholders_or_is_refused(front_end):
    image = make_image(32, 32)
    full = process(front_end, {"prompt": PROMPT, "multi_modal_data": {"image": image}})
    keep = len(full.prompt_token_ids) - 2
    truncated = process(front_end, {"prompt": PROMPT, "multi_modal_data": {"image": image}},
                        truncate_prompt_tokens=keep)
    assert truncated.prompt_token_ids == full.prompt_token_ids[2:]
    assert truncated.mm_features[0].offset == full.mm_features[0].offset - 2
    assert truncated.mm_features[0].identifier == full.mm_features[0].identifier
    with pytest.raises(ValidationError) as error:
        process(front_end, {"prompt": PROMPT, "multi_modal_data": {"image": image}}, truncate_prompt_tokens=10)
    assert error.value.param == "truncate_prompt_tokens"


def test_children_of_n_share_the_images(front_end):
    request = process(front_end, {"prompt": PROMPT, "multi_modal_data": {"image": make_image(32, 32)}},
                      n=2, temperature=1.0, seed=1)
    children = front_end.register(request, PROMPT)
    assert [child.mm_features for child in children] == [request.mm_features] * 2
    front_end.output_processor.abort_requests([request.request_id])


def test_the_engine_options_reach_the_front_end(front_end, llava_checkpoint):
    with pytest.raises(ValidationError) as error:
        process(front_end, {"prompt": IMAGE_TOKEN * 4, "multi_modal_data": {"image": [make_image(8, 8)] * 4}})
    assert error.value.param == "multi_modal_data" and "At most 3" in error.value.message
    with pytest.raises(ValidationError) as error:  # max_image_pixels=100_000
        process(front_end, {"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": make_image(400, 300)}})
    assert error.value.param == "multi_modal_data.image" and "120000 pixels" in error.value.message


def test_image_options_parse_and_validate(tmp_path):
    assert parse_modality_limits('{"image": 2}') == {"image": 2}
    assert parse_modality_limits("image=2,video=0") == {"image": 2, "video": 0}
    for bad in ('{"imag": 2}', '{"image": -1}', '{"image": 1.5}', "image", "[1]"):
        with pytest.raises(ValueError):
            parse_modality_limits(bad)
    assert parse_name_list(" a.example, B.example ,") == ["a.example", "B.example"]
    config = EngineArgs(limit_mm_per_prompt='{"image": 2}', allowed_media_domains="Images.Example,cdn.example",
                        allowed_local_media_path=str(tmp_path), max_image_bytes="2MiB").create_engine_config()
    multimodal = config.multimodal
    assert multimodal.limit_per_prompt == {"image": 2}
    assert multimodal.allowed_media_domains == ("images.example", "cdn.example")
    assert multimodal.allowed_local_media_path == str(tmp_path.resolve())
    assert multimodal.max_image_bytes == 2 * 2**20
    # the config crosses to the engine process in msgpack
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig) == config
    defaults = EngineArgs().create_engine_config().multimodal
    assert defaults.allowed_media_domains == () and defaults.allowed_local_media_path is None
    with pytest.raises(ConfigError, match="allowed_local_media_path"):
        EngineArgs(allowed_local_media_path=str(tmp_path / "absent")).create_engine_config()
    with pytest.raises(ConfigError, match="limit_mm_per_prompt"):
        EngineArgs(limit_mm_per_prompt={"imag": 2}).create_engine_config()
