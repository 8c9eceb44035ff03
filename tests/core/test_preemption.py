"""Preemption under KV pressure changes nothing in the outputs: each request, greedy or seeded, gets
exactly what it gets when it runs alone with room to spare."""

from __future__ import annotations

import pytest

from quire.core.config import ModelConfig
from quire.offline import LLM, SamplingParams

pytestmark = pytest.mark.reliability

MAX_MODEL_LEN = 256
PROMPT_LENS = (5, 40, 90, 130, 17, 64, 200, 33)


def params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=48, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def test_outputs_under_preemption_equal_each_request_alone(llama_checkpoint, corpus_token_ids):
    prompts = [corpus_token_ids[i * 300:i * 300 + n] for i, n in enumerate(PROMPT_LENS)]
    roomy = LLM(llama_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN)
    alone = [roomy.generate([p], params(i), use_tqdm=False)[0].outputs[0].token_ids for i, p in enumerate(prompts)]
    bytes_per_block = ModelConfig.from_hf(llama_checkpoint, "float32").kv_bytes_per_token * 16
    tight = LLM(llama_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN,
                kv_cache_memory=bytes_per_block * (MAX_MODEL_LEN // 16 + 4))  # about one and a bit sequences
    together = tight.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False)
    assert tight.llm_engine.scheduler_stats.num_preemptions >= 3, "the KV budget caused too little preemption"
    assert [o.outputs[0].token_ids for o in together] == alone
    tight.llm_engine.check_idle_invariants()
