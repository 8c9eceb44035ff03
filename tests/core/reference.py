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
