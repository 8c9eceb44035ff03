"""The Qwen2.5-VL model as the engine builds it: image embeddings equal transformers' ``get_image_features``
(windowed and full attention), M-RoPE positions equal ``get_rope_index``, a prompt with an image gives
transformers' logits, text prompts decode as transformers' generate does, and both checkpoint layouts load."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from quire.core.attention.metadata import AttentionMetadata
from quire.core.engine_args import EngineArgs
from quire.core.models.qwen2_5_vision import window_order
from quire.core.testing.multimodal_checkpoints import sample_image
from quire.core.worker.kv_cache import allocate_kv_caches
from quire.core.worker.model_runner import ModelRunner
from tests.multimodal.helpers import assert_text_only_greedy_equals_transformers

NUM_NEW_TOKENS = 16
BLOCK_SIZE = 16
# (width, height, seed): 80x48 becomes a 6 x 10 patch grid (3 x 5 merged: six 2 x 2 windows, four cut short);
# 30x70 becomes 8 x 4 (4 x 2 merged: two windows).
IMAGES = [(80, 48, 1), (30, 70, 2)]


@pytest.fixture(scope="module")
def hf_model(qwen2_5_vl_checkpoint):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processed_images(qwen2_5_vl_checkpoint):
    """Each image of ``IMAGES`` as the checkpoint's image processor makes it, alone: ``pixel_values``
    ``[t*h*w, 3 * 2 * 8 * 8]`` float32 and ``image_grid_thw`` ``[1, 3]``."""
    processor = AutoImageProcessor.from_pretrained(qwen2_5_vl_checkpoint)
    return [dict(processor(images=[sample_image(*image)], return_tensors="pt")) for image in IMAGES]


@pytest.fixture(scope="module")
def model(qwen2_5_vl_checkpoint):
    return engine_model(qwen2_5_vl_checkpoint, "float32")


def engine_model(folder, dtype: str) -> torch.nn.Module:
    """The model as the engine's ModelRunner builds, loads and prepacks it."""
    return ModelRunner(EngineArgs(model=str(folder), dtype=dtype, device="cpu").create_engine_config()).model


def transformers_image_features(hf_model, image: dict) -> torch.Tensor:
    with torch.no_grad():
        per_image = hf_model.model.get_image_features(image["pixel_values"], image["image_grid_thw"]).pooler_output
    return torch.cat(list(per_image))


def prompt_ids(folder, pieces: list[str | dict]) -> list[int]:
    """Token ids of ``pieces`` (text, or a processed image), each image expanded as Qwen2_5_VLProcessor expands
    it: ``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>``."""
    text = ""
    for piece in pieces:
        if isinstance(piece, str):
            text += piece
        else:
            num_tokens = int(piece["image_grid_thw"].prod()) // 4
            text += "<|vision_start|>" + "<|image_pad|>" * num_tokens + "<|vision_end|>"
    return AutoTokenizer.from_pretrained(folder).encode(text)


def test_image_embeddings_equal_transformers(model, hf_model, processed_images):
    vision = model.vision_config
    windows = []
    for image in processed_images:
        grid = tuple(image["image_grid_thw"][0].tolist())
        windows.append(window_order(grid, vision.spatial_merge_size, vision.window_blocks)[1])
        expected = transformers_image_features(hf_model, image)
        with torch.inference_mode():
            got = model.embed_multimodal("image", image)
        assert got.dtype == torch.float32 and got.shape == expected.shape == (grid[1] * grid[2] // 4, 64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert [tuple(image["image_grid_thw"][0].tolist()) for image in processed_images] == [(1, 6, 10), (1, 8, 4)]
    # merge blocks per window: several windows per image (so windowed blocks differ from full-attention ones),
    # some cut short at the edges
    assert windows == [[4, 4, 2, 2, 2, 1], [4, 4]]


def test_bfloat16_image_embeddings_are_close_to_float32_transformers(qwen2_5_vl_checkpoint, hf_model,
                                                                      processed_images):
    """The bfloat16 model (linear layers prepacked for the CPU's fastest path) returns bfloat16 rows within
    bfloat16's rounding of the float32 reference."""
    model = engine_model(qwen2_5_vl_checkpoint, "bfloat16")
    for image in processed_images:
        expected = transformers_image_features(hf_model, image)
        with torch.inference_mode():
            got = model.embed_multimodal("image", image)
        assert got.dtype == torch.bfloat16
        relative_error = ((got.float() - expected).norm() / expected.norm()).item()
        assert relative_error < 2e-2, relative_error


def test_malformed_image_inputs_are_refused(model, processed_images):
    image = processed_images[0]
    with pytest.raises(ValueError, match="audio"):
        model.embed_multimodal("audio", image)
    with pytest.raises(ValueError, match="rows of pixel_values"):
        model.embed_multimodal("image", {**image, "pixel_values": image["pixel_values"][:-4]})


def test_mrope_positions_equal_transformers(qwen2_5_vl_checkpoint, model, hf_model, processed_images):
    """Two images with text before, between and after them."""
    first, second = processed_images
    ids = prompt_ids(qwen2_5_vl_checkpoint, ["<|im_start|>user\nclass Point:", first, " def norm(self):",
                                             second, " return x<|im_end|>\n<|im_start|>assistant\n"])
    input_ids = torch.tensor([ids])
    grids = torch.cat([first["image_grid_thw"], second["image_grid_thw"]])
    expected, expected_delta = hf_model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == model.config.image_token_id).int(), image_grid_thw=grids)
    positions, delta = model.mrope_positions(ids, [tuple(grid) for grid in grids.tolist()])
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == expected_delta.item() < 0
    assert not (positions[0] == positions[1]).all()  # the image rows are not text positions


def test_text_only_mrope_positions_are_the_sequence(model):
    positions, delta = model.mrope_positions(list(range(7)), [])
    np.testing.assert_array_equal(positions, np.tile(np.arange(7), (3, 1)))
    assert delta == 0


def test_mrope_positions_refuse_placeholders_that_do_not_fit(model):
    image_token = model.config.image_token_id
    with pytest.raises(ValueError, match="need 6"):
        model.mrope_positions([1, *[image_token] * 5, 2], [(1, 4, 6)])
    with pytest.raises(ValueError, match="line up"):  # two images of 2 tokens each, but runs of 1 and 3
        model.mrope_positions([image_token, 9, image_token, image_token, image_token], [(1, 2, 4), (1, 2, 4)])


def prefill(model, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
            kv_caches=None, num_cached: int = 0):
    """Logits of every token of one request whose first ``num_cached`` tokens are in ``kv_caches`` already."""
    num_tokens = input_ids.shape[0]
    if kv_caches is None:
        kv_caches = allocate_kv_caches(model.config, 8, BLOCK_SIZE)
    block_table = torch.arange(1, 8).view(1, 7)  # block 0 is the null block
    slots = torch.arange(num_cached, num_cached + num_tokens) + BLOCK_SIZE
    metadata = AttentionMetadata(slot_mapping=slots, block_tables=block_table, query_start_loc=[0, num_tokens],
                                 seq_lens=[num_cached + num_tokens], max_query_len=num_tokens, block_size=BLOCK_SIZE)
    model.language_model.model.backend.prepare(metadata)
    with torch.inference_mode():
        hidden = model(input_ids, positions, kv_caches, metadata, inputs_embeds=inputs_embeds)
        return model.compute_logits(hidden), kv_caches


def test_prefill_and_decode_logits_equal_transformers(qwen2_5_vl_checkpoint, model, hf_model, processed_images):
    """A prompt with one image, prefilled with its image rows and M-RoPE positions, then one decode step at
    sequence position ``p + delta``: every token's logits equal transformers' (float32)."""
    image = processed_images[0]
    ids = prompt_ids(qwen2_5_vl_checkpoint, ["<|im_start|>user\n", image, "def area(self):<|im_end|>\n"
                                             "<|im_start|>assistant\n"])
    input_ids = torch.tensor(ids)
    is_image = input_ids == model.config.image_token_id
    with torch.inference_mode():
        embeds = model.embed_input_ids(input_ids)
        embeds[is_image] = model.embed_multimodal("image", image)
    positions, delta = model.mrope_positions(ids, [tuple(image["image_grid_thw"][0].tolist())])
    logits, kv_caches = prefill(model, input_ids, torch.from_numpy(positions), embeds)
    next_token = int(logits[-1].argmax())
    decode_position = torch.full((3, 1), len(ids) + delta)
    decode_logits, _ = prefill(model, torch.tensor([next_token]), decode_position, None, kv_caches, len(ids))

    full_ids = torch.tensor([[*ids, next_token]])
    with torch.no_grad():
        expected = hf_model(input_ids=full_ids, pixel_values=image["pixel_values"],
                            image_grid_thw=image["image_grid_thw"],
                            mm_token_type_ids=(full_ids == model.config.image_token_id).int()).logits[0]
    torch.testing.assert_close(logits, expected[:-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_logits, expected[-1:], rtol=1e-4, atol=1e-4)
    # the sequence positions would not do: M-RoPE is what makes the logits equal
    wrong, _ = prefill(model, input_ids, torch.arange(len(ids)), embeds)
    assert (wrong - expected[:-1]).abs().max() > 1e-1


def test_one_dimensional_positions_are_three_equal_rows(model, corpus_token_ids):
    input_ids = torch.tensor(corpus_token_ids[:40])
    from_rows, _ = prefill(model, input_ids, torch.arange(40).expand(3, -1).contiguous())
    from_sequence, _ = prefill(model, input_ids, torch.arange(40))
    torch.testing.assert_close(from_sequence, from_rows, rtol=0, atol=0)


def test_decode_stack_rotates_by_mrope_positions(qwen2_5_vl_checkpoint, corpus_token_ids):
    """int8 weights put decode steps on the C++ decoder stack on any CPU: it rotates by the three rows' factors
    exactly as the modules do."""
    model = ModelRunner(EngineArgs(model=str(qwen2_5_vl_checkpoint), dtype="float32", device="cpu",
                                   quantization="int8").create_engine_config()).model
    language_model = model.language_model.model
    stack, num_stack_calls = language_model.decode_stack, []
    assert stack is not None

    class CountingStack:
        num_layers = stack.num_layers

        def forward(self, *args):
            num_stack_calls.append(1)
            return stack.forward(*args)

    input_ids = torch.tensor(corpus_token_ids[:20])
    prompt_positions = torch.stack([torch.arange(20), torch.arange(20) // 2, torch.arange(20) % 5])
    decode_position = torch.tensor([[20], [11], [3]])
    logits = []
    for decode_stack in (CountingStack(), None):
        language_model.decode_stack = decode_stack
        _, kv_caches = prefill(model, input_ids, prompt_positions)
        logits.append(prefill(model, torch.tensor([7]), decode_position, None, kv_caches, 20)[0])
    assert len(num_stack_calls) == 1  # the decode step, not the prompt
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    _, kv_caches = prefill(model, input_ids, prompt_positions)
    as_text = prefill(model, torch.tensor([7]), torch.tensor([20]), None, kv_caches, 20)[0]
    assert (as_text - logits[1]).abs().max() > 1e-2  # the rows mattered


def test_text_only_greedy_equals_transformers(qwen2_5_vl_checkpoint, hf_model, corpus_token_ids):
    assert_text_only_greedy_equals_transformers(qwen2_5_vl_checkpoint, hf_model, corpus_token_ids, NUM_NEW_TOKENS)


def transformers_5_name(name: str) -> str:
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def test_transformers_5_module_names_load_the_same_weights(qwen2_5_vl_checkpoint, model, hf_model, tmp_path):
    """The checkpoint as saved (the Hub's names: ``model.``, ``visual.``, ``lm_head.``) and renamed to transformers
    5.x's module names (``model.language_model.``, ``model.visual.``) load the same parameters."""
    folder = tmp_path / "module-names"
    shutil.copytree(qwen2_5_vl_checkpoint, folder)
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    assert any(name.startswith("visual.") for name in tensors) and any(name.startswith("model.") for name in tensors)
    renamed = {transformers_5_name(name): tensor for name, tensor in tensors.items()}
    assert len(renamed) == len(tensors) and renamed.keys() != tensors.keys()
    save_file(renamed, weights_file, metadata={"format": "pt"})
    reread = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert all(torch.equal(reread[name], tensor) for name, tensor in hf_model.state_dict().items())
    expected = dict(model.named_parameters())
    loaded = dict(engine_model(folder, "float32").named_parameters())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], parameter) for name, parameter in expected.items())
