"""The LLaVA model as the engine builds it: image embeddings equal transformers' ``get_image_features``, text
prompts decode as transformers' generate does, every checkpoint layout loads, and ``inputs_embeds`` replaces
the token lookup (through the C++ decoder stack too)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from quire.core.engine_args import EngineArgs
from quire.core.testing.multimodal_checkpoints import IMAGE_TOKEN
from quire.core.testing.multimodal_checkpoints import sample_image as make_image
from quire.core.worker.model_runner import ModelRunner
from quire.offline import LLM, SamplingParams
from tests.multimodal.helpers import assert_text_only_greedy_equals_transformers

NUM_NEW_TOKENS = 16
# Checkpoint layouts, as prefix renames of the names transformers 5.24 saves (``language_model.model.``,
# ``language_model.lm_head.``, ``multi_modal_projector.``, and ``vision_tower.`` without 4.x's CLIP level).
LAYOUTS = {
    # llava-hf's checkpoints on the Hub
    "transformers-4": (("vision_tower.", "vision_tower.vision_model."),),
    # transformers 5.x's module names
    "module-names": (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")),
}


@pytest.fixture(scope="module")
def hf_llava(llava_checkpoint):
    return LlavaForConditionalGeneration.from_pretrained(llava_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def images_pixel_values(llava_checkpoint):
    """Two images of different sizes and aspect ratios, each processed alone: ``[1, 3, 32, 32]`` float32."""
    processor = AutoProcessor.from_pretrained(llava_checkpoint)
    return [processor(text=IMAGE_TOKEN, images=image, return_tensors="pt")["pixel_values"]
            for image in (make_image(40, 24, seed=1), make_image(20, 52, seed=2))]


def engine_model(folder, dtype: str) -> torch.nn.Module:
    """The model as the engine's ModelRunner builds, loads and prepacks it."""
    return ModelRunner(EngineArgs(model=str(folder), dtype=dtype, device="cpu").create_engine_config()).model


def transformers_image_features(hf_llava, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        per_image = hf_llava.model.get_image_features(pixel_values=pixel_values).pooler_output
    return torch.cat(list(per_image))


def test_image_embeddings_equal_transformers(llava_checkpoint, hf_llava, images_pixel_values):
    model = engine_model(llava_checkpoint, "float32")
    embeddings = []
    for pixel_values in images_pixel_values:
        assert pixel_values.shape == (1, 3, 32, 32) and pixel_values.dtype == torch.float32
        expected = transformers_image_features(hf_llava, pixel_values)
        with torch.inference_mode():
            got = model.embed_multimodal("image", {"pixel_values": pixel_values})
        assert got.dtype == torch.float32 and got.shape == expected.shape == (16, 64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        embeddings.append(got)
    assert not torch.allclose(*embeddings, atol=1e-2)  # the two images are told apart


def test_bfloat16_image_embeddings_are_close_to_float32_transformers(llava_checkpoint, hf_llava,
                                                                      images_pixel_values):
    """The bfloat16 model (its linear layers prepacked for the CPU's fastest path) returns bfloat16 rows
    within bfloat16's rounding of the float32 reference."""
    model = engine_model(llava_checkpoint, "bfloat16")
    for pixel_values in images_pixel_values:
        expected = transformers_image_features(hf_llava, pixel_values)
        with torch.inference_mode():
            got = model.embed_multimodal("image", {"pixel_values": pixel_values})
        assert got.dtype == torch.bfloat16
        relative_error = ((got.float() - expected).norm() / expected.norm()).item()
        assert relative_error < 2e-2, relative_error


def test_unknown_modality_is_refused(llava_checkpoint, images_pixel_values):
    model = engine_model(llava_checkpoint, "float32")
    with pytest.raises(ValueError, match="audio"):
        model.embed_multimodal("audio", {"pixel_values": images_pixel_values[0]})


def test_text_only_greedy_equals_transformers(llava_checkpoint, hf_llava, corpus_token_ids):
    assert_text_only_greedy_equals_transformers(llava_checkpoint, hf_llava, corpus_token_ids, NUM_NEW_TOKENS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_checkpoint_layouts_load_the_same_weights(llava_checkpoint, hf_llava, tmp_path, layout):
    folder = tmp_path / layout
    shutil.copytree(llava_checkpoint, folder)
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    renamed = {}
    for name, tensor in tensors.items():
        prefix, other = next(((p, other) for p, other in LAYOUTS[layout] if name.startswith(p)), ("", ""))
        renamed[other + name[len(prefix):]] = tensor
    assert len(renamed) == len(tensors) and renamed.keys() != tensors.keys()
    save_file(renamed, weights_file, metadata={"format": "pt"})
    # the copy is a layout transformers reads: back into the same model
    reread = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert all(torch.equal(reread[name], tensor) for name, tensor in hf_llava.state_dict().items())
    expected = dict(engine_model(llava_checkpoint, "float32").named_parameters())
    loaded = dict(engine_model(folder, "float32").named_parameters())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], parameter) for name, parameter in expected.items())


def generate_with_logprobs(llm: LLM, prompts):
    llm.reset_prefix_cache()  # every run computes its prompts from scratch
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["llava", "llama"])
def test_inputs_embeds_replace_the_token_lookup(request, corpus_token_ids, name):
    """``forward`` given zeroed token ids and the real tokens' ``inputs_embeds`` generates exactly what it
    does from the token ids, prompt and decode steps alike; int8 weights put decodes on the C++ decoder stack
    on any CPU."""
    folder = request.getfixturevalue(f"{name}_checkpoint")
    llm = LLM(str(folder), dtype="float32", quantization="int8", max_model_len=256, max_num_seqs=4)
    model = llm.llm_engine.engine_core.engine_core.executor.model_runner.model
    language_model = model.language_model.model if name == "llava" else model.model
    stack, stack_batch_sizes = language_model.decode_stack, []
    assert stack is not None

    class CountingStack:
        num_layers = stack.num_layers

        def forward(self, *args):
            stack_batch_sizes.append(args[0].shape[0])
            return stack.forward(*args)

    language_model.decode_stack = CountingStack()
    prompts = [corpus_token_ids[i * 200:i * 200 + n] for i, n in enumerate((3, 20, 45))]
    from_ids = generate_with_logprobs(llm, prompts)
    forward = model.forward

    def forward_from_embeds(input_ids, positions, kv_caches, metadata, inputs_embeds=None):
        assert inputs_embeds is None  # text prompts: the runner passes token ids
        return forward(torch.zeros_like(input_ids), positions, kv_caches, metadata,
                       inputs_embeds=model.embed_input_ids(input_ids))

    model.forward = forward_from_embeds
    num_stack_calls = len(stack_batch_sizes)
    from_embeds = generate_with_logprobs(llm, prompts)
    assert len(stack_batch_sizes) > num_stack_calls > 0  # both runs decoded through the stack
    assert from_embeds == from_ids
