"""Greedy decoding compared with transformers on the same GGUF file, under the margin rule."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

NUM_NEW_TOKENS = 32
# The margin rule of tests/core/test_transformers_equality.py: float32 sums in another order may flip only
# a near-tie, so the ids must be equal up to a step whose reference top-1/top-2 logprob gap is below this.
NEAR_TIE = 1e-3

def transformers_greedy(path, prompts, model=None, num_tokens=NUM_NEW_TOKENS):
    """Per prompt: (greedy ids, top-1 minus top-2 logprob at each step), transformers on the GGUF file."""
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
        results.append((out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return results


def assert_greedy_agrees(quire_ids, reference, prompts, num_tokens=NUM_NEW_TOKENS):
    compared = 0
    for prompt, got, (expected, margins) in zip(prompts, quire_ids, reference):
        for step, (mine, theirs, margin) in enumerate(zip(got, expected, margins)):
            if mine != theirs:
                assert margin <= NEAR_TIE, (f"prompt of {len(prompt)} tokens: step {step} differs "
                                            f"({mine} vs {theirs}) with a clear margin {margin:.2e}")
                break
            compared += 1
    assert compared >= len(prompts) * num_tokens * 0.9, f"only {compared} tokens compared"
