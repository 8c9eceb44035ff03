"""The CUDA path end to end (run by benchmarks/gpu_check.sh; skipped on machines without a CUDA device)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.offline import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT_LENS = (1, 9, 17, 64, 150)
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 500:i * 500 + n] for i, n in enumerate(PROMPT_LENS)]


def hf_greedy(path, prompts):
    """Per prompt: transformers' greedy ids, cut before the first step whose top-1 margin is under 1e-3
    (there, float noise between two correct implementations may pick either token)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                             output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        clear = next((step for step, margin in enumerate(margins) if margin < 1e-3), len(margins))
        results.append(out.sequences[0, len(prompt):len(prompt) + clear].tolist())
    assert sum(map(len, results)) >= len(prompts) * NUM_NEW_TOKENS // 2, "too few clear steps to compare"
    return results


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_cuda_greedy_equals_transformers(tiny_checkpoint, prompts, enforce_eager):
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", device="cuda", enforce_eager=enforce_eager, max_num_batched_tokens=64,
              max_model_len=512, gpu_memory_utilization=0.3, multiprocess=False)
    runner = llm.llm_engine.engine_core.engine_core.executor.model_runner
    assert runner.device.type == "cuda" and runner.attn_backend.name == "triton"
    assert (runner.cuda_graphs is None) == enforce_eager
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(path, prompts)
    assert [o.outputs[0].token_ids[:len(ids)] for o, ids in zip(outputs, expected)] == expected


def test_kv_cache_sized_from_the_memory_fraction(tiny_checkpoint):
    import gc

    path = tiny_checkpoint("llama")
    small = LLM(path, device="cuda", gpu_memory_utilization=0.2, enforce_eager=True, multiprocess=False)
    blocks_small = small.llm_engine.engine_core.engine_core.num_blocks
    small.shutdown()
    del small
    gc.collect()
    torch.cuda.empty_cache()
    large = LLM(path, device="cuda", gpu_memory_utilization=0.4, enforce_eager=True, multiprocess=False)
    blocks_large = large.llm_engine.engine_core.engine_core.num_blocks
    assert blocks_large > 1.8 * blocks_small


def test_public_ops_dispatch_to_triton_on_cuda():
    from quire.kernels.activation import silu_and_mul, silu_and_mul_reference
    from quire.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_reference

    x = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(96, device="cuda", dtype=torch.bfloat16)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_sum = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=2e-2, rtol=1e-2)
