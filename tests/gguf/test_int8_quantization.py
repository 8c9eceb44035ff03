"""``--quantization int8``: a float checkpoint's linear layers on int8 weights with per-row scales.

The engine's int8 model must compute exactly what a float32 model with the same rounded weights computes:
transformers, with every linear layer's weight replaced by its int8 round trip, is the oracle. (How far
int8 moves greedy outputs away from bfloat16 is a property of the checkpoint, measured by
``hatch run bench-gguf --sections int8``.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from quire.kernels import quant
from quire.offline import LLM, SamplingParams
from tests.gguf.greedy import assert_greedy_agrees

NUM_TOKENS = 32


def greedy_with_margins(model, prompts):
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
        results.append((out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return results


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_int8_greedy_ids_equal_transformers_on_the_rounded_weights(tiny_checkpoint, corpus_token_ids, arch):
    checkpoint = tiny_checkpoint(arch)
    prompts = [corpus_token_ids[i * 300:i * 300 + 20 + 5 * i] for i in range(8)]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tied = reference.config.tie_word_embeddings
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and not (tied and name == "lm_head"):
                module.weight.copy_(quant.dequantize_reference(quant.quantize_int8(module.weight)))
    llm = LLM(str(checkpoint), dtype="float32", quantization="int8", max_model_len=512)
    model = llm.llm_engine.engine_core.engine_core.executor.model_runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and [w.qtype for w in qkv.quantized] == ["INT8"]
    assert llm.llm_engine.model_config.quantization == "int8"
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    assert_greedy_agrees([o.outputs[0].token_ids for o in outputs], greedy_with_margins(reference, prompts), prompts,
                         NUM_TOKENS)


def test_int8_runs_a_bfloat16_model(tiny_checkpoint, corpus_token_ids):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization="int8", max_model_len=512)
    out = llm.generate([{"prompt_token_ids": corpus_token_ids[:40]}],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
