"""Greedy token ids equal transformers' generate: alone, batched, chunked and under preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core.config import ModelConfig
from quire.offline import LLM, SamplingParams
from tests.core.reference import assert_bfloat16_agrees

PROMPT_LENS = (1, 3, 17, 64, 100, 177, 256, 300)
NUM_NEW_TOKENS = 32
FLOAT32_MIN_MARGIN = 1e-3
MAX_MODEL_LEN = 336  # longest prompt + new tokens, rounded up to whole blocks


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 700:i * 700 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoint, prompts):
    """(arch, dtype) -> per prompt: (greedy ids, top-1 minus top-2 logprob at each step)."""
    cache = {}

    def get(arch, dtype):
        if (arch, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=getattr(torch, dtype))
            model.generation_config.eos_token_id = None  # exactly NUM_NEW_TOKENS, like ignore_eos
            results = []
            for prompt in prompts:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
                logprobs = torch.stack(out.scores)[:, 0].float().log_softmax(-1)
                top2 = logprobs.topk(2, dim=-1).values
                results.append((out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
            if dtype == "float32":
                smallest = min(min(margins) for _, margins in results)
                assert smallest > FLOAT32_MIN_MARGIN, (
                    f"{arch} checkpoint not peaked enough: a greedy margin of {smallest:.2e} could flip "
                    "on float noise; pick another seed or a larger logit_std")
            cache[arch, dtype] = results
        return cache[arch, dtype]

    return get


def greedy_params():
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def run_quire(checkpoint, dtype, prompts, mode, max_model_len=MAX_MODEL_LEN, **engine_options):
    kwargs = dict(dtype=dtype, max_model_len=max_model_len, **engine_options)
    if mode == "chunked":
        kwargs["max_num_batched_tokens"] = 64
    if mode == "preempted":
        # the least that is allowed: one full-length sequence (21 blocks of 16 by default) and the null block
        bytes_per_block = ModelConfig.from_hf(checkpoint, dtype).kv_bytes_per_token * 16
        kwargs["kv_cache_memory"] = bytes_per_block * (max_model_len // 16 + 1)
    llm = LLM(checkpoint, **kwargs)
    if mode == "alone":
        outputs = [llm.generate([p], greedy_params(), use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    if mode == "preempted":
        assert llm.llm_engine.scheduler_stats.num_preemptions > 0, "the KV budget caused no preemption"
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float32_greedy_equals_transformers(tiny_checkpoint, hf_reference, prompts, arch, mode):
    reference = hf_reference(arch, "float32")
    quire_ids = run_quire(tiny_checkpoint(arch), "float32", prompts, mode)
    for prompt, got, (expected, _) in zip(prompts, quire_ids, reference):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_greedy_matches_transformers_where_margins_are_clear(
        tiny_checkpoint, hf_reference, prompts, arch, mode):
    reference = hf_reference(arch, "bfloat16")
    quire_ids = run_quire(tiny_checkpoint(arch), "bfloat16", prompts, mode)
    assert_bfloat16_agrees(prompts, quire_ids, reference, NUM_NEW_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_attention_backend_greedy_equals_transformers(tiny_checkpoint, hf_reference, prompts, arch):
    """The Triton backend's KV write and paged attention (in Triton's interpreter on machines without a
    GPU) through the whole engine: chunked prompts over cached prefixes, mixed batches, decodes."""
    reference = hf_reference(arch, "float32")
    quire_ids = run_quire(tiny_checkpoint(arch), "float32", prompts, "chunked", attention_backend="triton")
    for prompt, got, (expected, _) in zip(prompts, quire_ids, reference):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"
