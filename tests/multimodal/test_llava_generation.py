"""Prompts with images through the engine: greedy ids equal transformers' on the tiny LLaVA checkpoint
(float32, margin rule), alone, batched with text-only prompts, with chunked prefill splitting an image and
after preemption; the encoder cache and the prefix cache reuse an image and never mix two."""

from __future__ import annotations

import pytest
import torch

from quire.core.testing.multimodal_checkpoints import sample_image
from quire.offline import LLM, SamplingParams
from tests.gguf.greedy import assert_greedy_agrees

NUM_TOKENS = 16
MAX_MODEL_LEN = 256


def chat_text(*parts: str) -> str:
    """A ChatML user turn of ``parts`` (``"<image>"`` or text), as the checkpoint's template renders it."""
    return "<|im_start|>user\n" + "".join(parts) + "<|im_end|>\n<|im_start|>assistant\n"


# (prompt text, images): one image, two images of other sizes, an image mid-text, and text alone
CASES = [
    (chat_text("<image>", "def describe(self):"), [(40, 28, 1)]),
    (chat_text("<image>", "class Point:", "<image>", " return"), [(64, 48, 2), (20, 30, 3)]),
    (chat_text("import os\nfor name in os.listdir(path):\n    ", "<image>", "print(name)"), [(33, 33, 4)]),
    (chat_text("def __init__(self, value):\n    self.value ="), []),
]


@pytest.fixture(scope="module")
def cases():
    return [(text, [sample_image(*size) for size in sizes]) for text, sizes in CASES]


@pytest.fixture(scope="module")
def hf_llava(llava_checkpoint):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return AutoProcessor.from_pretrained(llava_checkpoint), model


def hf_greedy(hf_llava, text, images):
    """transformers' greedy ids and top-1/top-2 logprob margins (float32)."""
    processor, model = hf_llava
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


@pytest.fixture(scope="module")
def reference(hf_llava, cases):
    return [hf_greedy(hf_llava, text, images) for text, images in cases]


def prompts_of(cases):
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def stats(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler.make_stats()


def test_the_reference_depends_on_the_image_and_has_clear_margins(hf_llava, cases, reference):
    text, _ = cases[0]
    assert hf_greedy(hf_llava, text, [sample_image(40, 28, 99)])[0] != reference[0][0]
    assert min(m for _, margins in reference for m in margins) > 1e-3  # a real comparison, not near-ties


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
def test_greedy_ids_equal_transformers(llava_checkpoint, cases, reference, mode):
    kwargs = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    if mode == "chunked":
        kwargs["max_num_batched_tokens"] = 12  # chunks of 12 split every 16-token image
    if mode == "preempted":
        from quire.core.config import ModelConfig

        config = ModelConfig.from_hf(llava_checkpoint, "float32")
        # 7 usable blocks of 16 tokens (and the null block): the longest request fits, all four do not
        kwargs.update(max_model_len=112, kv_cache_memory=config.kv_bytes_per_token * 16 * 8)
    llm = LLM(str(llava_checkpoint), **kwargs)
    prompts = prompts_of(cases)
    if mode == "alone":
        outputs = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    if mode == "preempted":
        assert stats(llm).num_preemptions > 0
    if mode == "chunked":
        assert stats(llm).mm_cache_queries >= 4  # every image was encoded (and its chunks reused it)
    token_ids = [o.outputs[0].token_ids for o in outputs]
    assert_greedy_agrees(token_ids, reference, [o.prompt_token_ids for o in outputs], NUM_TOKENS)
    assert token_ids == [expected for expected, _ in reference]


def test_the_same_image_hits_the_encoder_and_prefix_caches_and_two_images_never_share(llava_checkpoint):
    llm = LLM(str(llava_checkpoint), dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    image, other = sample_image(40, 28, 1), sample_image(40, 28, 2)
    long_text = "def describe(self):\n    return self.name + ' at ' + str(self.position)\n" * 2

    def run(img, text):
        before = stats(llm)
        out = llm.generate([{"prompt": chat_text("<image>", text), "multi_modal_data": {"image": img}}],
                           greedy(), use_tqdm=False)[0]
        after = stats(llm)
        return out, after.prefix_cache_hits - before.prefix_cache_hits, after.mm_cache_hits - before.mm_cache_hits

    first, prefix_hits, mm_hits = run(image, long_text)
    assert (prefix_hits, mm_hits) == (0, 0)
    # the same image and text: the prefix cache holds the image's blocks, so its encoder output is not needed
    again, prefix_hits, mm_hits = run(image, long_text)
    assert prefix_hits > 16 and mm_hits == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # other text right after the image: only block 0 (3 text tokens and 13 image rows) is shared, and the
    # image's last rows take its cached encoder output
    _, prefix_hits, mm_hits = run(image, "x" + long_text)
    assert (prefix_hits, mm_hits) == (16, 1)
    # another image with the same placeholder ids and text: no block is shared, no encoder output reused
    _, prefix_hits, mm_hits = run(other, long_text)
    assert (prefix_hits, mm_hits) == (0, 0)
