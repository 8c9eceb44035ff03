"""Small references written from definitions, computed with transformers' logits."""

from __future__ import annotations

import math

import torch


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(token_ids), vocab]`` of a transformers model for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def reference_greedy(model, prompt: list[int], num_tokens: int, process=None) -> list[int]:
    """Greedy decoding where ``process(logits, prompt, output)`` may rewrite each step's logits."""
    output: list[int] = []
    for _ in range(num_tokens):
        logits = hf_logits(model, prompt + output)[-1]
        if process is not None:
            logits = process(logits.clone(), prompt, output)
        output.append(int(logits.argmax()))
    return output


def hf_greedy_with_margins(model, prompts: list[list[int]], num_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt: transformers' greedy ids (exactly ``num_tokens``: no EOS stop) and, at each step, the top-1
    minus top-2 logprob (how far float noise is from flipping the argmax)."""
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        scores = torch.stack(out.scores)[:, 0]
        top2 = scores.float().log_softmax(-1).topk(2, dim=-1).values
        spacings = logit_spacing(scores.max(dim=-1).values, model.dtype)
        results.append((out.sequences[0, len(prompt):].tolist(),
                        [Margin(m, s) for m, s in zip((top2[:, 0] - top2[:, 1]).tolist(), spacings)]))
    return results


class Margin(float):
    """A step's top-1 minus top-2 logprob, with ``spacing``: the step between adjacent values of the model's
    dtype at its top logit (bfloat16 logits between 8 and 16 come in steps of 1/16)."""

    def __new__(cls, value: float, spacing: float):
        margin = super().__new__(cls, value)
        margin.spacing = spacing
        return margin


def logit_spacing(top: torch.Tensor, dtype: torch.dtype) -> list[float]:
    """Per value of ``top``: the distance to the next representable value of ``dtype`` above its magnitude."""
    if not dtype.is_floating_point:
        return [0.0] * top.numel()
    resolution = torch.finfo(dtype).eps  # the spacing at 1
    return [resolution * 2.0 ** math.floor(math.log2(abs(v))) if v != 0 else resolution for v in top.tolist()]


# bfloat16 ids must agree wherever transformers' own top-1 margin is above this, and above two steps of the
# top logit's bfloat16 resolution (two logits, each rounded once, can swap places within two steps of each other:
# seen on an AVX2 machine, logits 12.125 and 12.0)
BF16_MARGIN = 0.1


def assert_bfloat16_agrees(prompts, quire_ids, reference, num_tokens: int, excuse=None) -> None:
    """The bfloat16 margin rule: per prompt, Quire's ids equal ``reference``'s (``hf_greedy_with_margins``)
    up to the first difference, which must fall where transformers' margin is at most ``BF16_MARGIN`` or two
    steps of its top logit's resolution (or
    where ``excuse(prompt, step, token)`` returns None; otherwise it returns why the step may not differ);
    at least half of all the tokens are compared before the sequences diverge."""
    num_compared = 0
    for prompt, got, (expected, margins) in zip(prompts, quire_ids, reference):
        for step, (mine, theirs, margin) in enumerate(zip(got, expected, margins)):
            if mine != theirs:
                clear = margin > max(BF16_MARGIN, 2 * getattr(margin, "spacing", 0.0))
                problem = f"differs with a clear margin {margin:.3f}" if clear else None
                if problem is not None and excuse is not None:
                    problem = excuse(prompt, expected[:step], mine, margin)
                assert problem is None, f"prompt of {len(prompt)} tokens: step {step} {problem}"
                break  # the sequences diverged; later steps no longer compare like with like
            num_compared += 1
    assert num_compared >= len(prompts) * num_tokens // 2, f"only {num_compared} tokens compared"
