"""Small references written from definitions, computed with transformers' logits."""

from __future__ import annotations

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
        top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
        results.append((out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return results


BF16_MARGIN = 0.1  # bfloat16 ids must agree wherever transformers' own top-1 margin is above this


def assert_bfloat16_agrees(prompts, quire_ids, reference, num_tokens: int, excuse=None) -> None:
    """The bfloat16 margin rule: per prompt, Quire's ids equal ``reference``'s (``hf_greedy_with_margins``)
    up to the first difference, which must fall where transformers' margin is at most ``BF16_MARGIN`` (or
    where ``excuse(prompt, step, token)`` returns None; otherwise it returns why the step may not differ);
    at least half of all the tokens are compared before the sequences diverge."""
    num_compared = 0
    for prompt, got, (expected, margins) in zip(prompts, quire_ids, reference):
        for step, (mine, theirs, margin) in enumerate(zip(got, expected, margins)):
            if mine != theirs:
                problem = (f"differs with a clear margin {margin:.3f}" if margin > BF16_MARGIN else None)
                if problem is not None and excuse is not None:
                    problem = excuse(prompt, expected[:step], mine, margin)
                assert problem is None, f"prompt of {len(prompt)} tokens: step {step} {problem}"
                break  # the sequences diverged; later steps no longer compare like with like
            num_compared += 1
    assert num_compared >= len(prompts) * num_tokens // 2, f"only {num_compared} tokens compared"
