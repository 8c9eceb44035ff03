"""Shared by the vision-language model tests: config files written by hand, and text-only greedy decoding
compared with transformers."""

from __future__ import annotations

import json

from quire.offline import LLM, SamplingParams
from tests.gguf.greedy import assert_greedy_agrees, transformers_greedy


def write_config(folder, hf: dict):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def assert_text_only_greedy_equals_transformers(folder, hf_model, corpus_token_ids, num_tokens: int) -> None:
    """Text prompts (no image) through ``LLM`` decode as transformers' ``generate`` does (margin rule)."""
    prompts = [corpus_token_ids[i * 500:i * 500 + n] for i, n in enumerate((1, 6, 37, 130))]
    reference = transformers_greedy(folder, prompts, model=hf_model, num_tokens=num_tokens)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_agrees([o.outputs[0].token_ids for o in outputs], reference, prompts, num_tokens)
