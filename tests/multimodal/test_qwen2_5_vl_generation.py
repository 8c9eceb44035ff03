"""Qwen2.5-VL prompts with images through the engine core (multimodal rotary positions in the runner): greedy
ids equal transformers' (float32, margin rule), alone, batched with a text-only prompt, and in chunks that
split images.

The requests are built here as the front end would build them (the image processor's outputs per image,
placeholders expanded): transformers' Qwen2.5-VL processor needs torchvision, which this environment lacks.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from quire.core.engine.core import EngineCore
from quire.core.engine_args import EngineArgs
from quire.core.sampling_params import SamplingParams
from quire.core.testing.multimodal_checkpoints import sample_image
from quire.core.wire import EngineCoreRequest, MultiModalFeature, TensorData
from tests.gguf.greedy import assert_greedy_agrees

NUM_TOKENS = 12
# (text pieces and images as (width, height, seed)) per prompt
PROMPTS = [
    ["<|im_start|>user\n", (80, 48, 1), "def area(self):<|im_end|>\n<|im_start|>assistant\n"],
    ["<|im_start|>user\nclass Point:", (30, 70, 2), " def norm(self):", (48, 48, 3),
     "<|im_end|>\n<|im_start|>assistant\n"],
    ["<|im_start|>user\nimport os\nfor name in os.listdir(path):<|im_end|>\n<|im_start|>assistant\n"],
]


@pytest.fixture(scope="module")
def prompts(qwen2_5_vl_checkpoint):
    """Per prompt: (token ids, [(offset, processed image)]), images expanded as Qwen2_5_VLProcessor does."""
    processor = AutoImageProcessor.from_pretrained(qwen2_5_vl_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(qwen2_5_vl_checkpoint)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    built = []
    for pieces in PROMPTS:
        ids, images = [], []
        for piece in pieces:
            if isinstance(piece, str):
                ids += tokenizer.encode(piece)
                continue
            image = dict(processor(images=[sample_image(*piece)], return_tensors="pt"))
            ids += tokenizer.encode("<|vision_start|>")
            images.append((len(ids), image))
            ids += [pad] * (int(image["image_grid_thw"].prod()) // 4)
            ids += tokenizer.encode("<|vision_end|>")
        built.append((ids, images))
    return built


@pytest.fixture(scope="module")
def reference(qwen2_5_vl_checkpoint, prompts):
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    results = []
    for ids, images in prompts:
        input_ids = torch.tensor([ids])
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                  # as the processor returns it: transformers places the 3-D positions by it
                  "mm_token_type_ids": (input_ids == model.config.image_token_id).int()}
        if images:
            inputs["pixel_values"] = torch.cat([image["pixel_values"] for _, image in images])
            inputs["image_grid_thw"] = torch.cat([image["image_grid_thw"] for _, image in images])
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
        results.append((out.sequences[0, len(ids):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return results


def engine_request(index: int, ids: list[int], images) -> EngineCoreRequest:
    features = []
    for offset, image in images:
        data = {"pixel_values": TensorData.from_array(image["pixel_values"].numpy()),
                "image_grid_thw": TensorData.from_array(image["image_grid_thw"].numpy())}
        identifier = hashlib.sha256(image["pixel_values"].numpy().tobytes()).hexdigest()
        features.append(MultiModalFeature("image", identifier, offset, int(image["image_grid_thw"].prod()) // 4,
                                          data))
    return EngineCoreRequest(f"r{index}", ids, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
                             [], 0.0, mm_features=features or None)


def run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens = {request.request_id: [] for request in requests}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
    return tokens


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
def test_greedy_ids_equal_transformers(qwen2_5_vl_checkpoint, prompts, reference, mode):
    assert min(m for _, margins in reference for m in margins) > 1e-3  # clear margins: a real comparison
    kwargs = dict(max_model_len=256, max_num_batched_tokens=7 if mode == "chunked" else 2048)
    if mode == "preempted":
        from quire.core.config import ModelConfig

        # 5 usable blocks of 16 tokens: the longest request fits, the three together do not
        bytes_per_block = ModelConfig.from_hf(qwen2_5_vl_checkpoint, "float32").kv_bytes_per_token * 16
        kwargs.update(max_model_len=80, kv_cache_memory=bytes_per_block * 6)
    args = EngineArgs(model=str(qwen2_5_vl_checkpoint), dtype="float32", enable_prefix_caching=False, **kwargs)
    core = EngineCore(args.create_engine_config())
    requests = [engine_request(i, ids, images) for i, (ids, images) in enumerate(prompts)]
    if mode == "alone":
        tokens = {}
        for request in requests:
            tokens.update(run(core, [request]))
    else:
        tokens = run(core, requests)
    if mode == "preempted":
        assert core.scheduler.num_preemptions > 0
    got = [tokens[request.request_id] for request in requests]
    assert_greedy_agrees(got, reference, [ids for ids, _ in prompts], NUM_TOKENS)
    assert got == [expected for expected, _ in reference]


def test_the_front_end_renders_and_expands_images_without_transformers_processor(qwen2_5_vl_checkpoint, prompts,
                                                                                 reference):
    """``LLM`` on the folder (the image processor and tokenizer stand in for the processor class, which needs
    torchvision here): a text prompt and a chat with the same images give the same token ids as the
    hand-built requests, and the same greedy output as transformers."""
    from quire.offline import LLM

    llm = LLM(str(qwen2_5_vl_checkpoint), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    for (ids, _), (expected, _), pieces in zip(prompts[:2], reference, PROMPTS):
        text = "".join(piece if isinstance(piece, str) else placeholder for piece in pieces)
        images = [sample_image(*piece) for piece in pieces if not isinstance(piece, str)]
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == expected
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": sample_image(*PROMPTS[0][1])},
                                                  {"type": "text", "text": "def area(self):"}]}], params,
                    use_tqdm=False)[0]
    assert chat.prompt_token_ids == prompts[0][0] and chat.outputs[0].token_ids == reference[0][0]
