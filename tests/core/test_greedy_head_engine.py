"""Plain greedy steps of a bfloat16 model take the screened LM head (``greedy_tokens``: oneDNN with AVX-512
VNNI, or linear_bf16 with AVX2) and produce the same tokens as the full logits; other steps keep the logits."""

from __future__ import annotations

import pytest
import torch

from quire.kernels import cpu_extension, greedy_head
from quire.kernels import linear as linear_ops
from quire.offline import LLM, SamplingParams

KERNELS = cpu_extension.load()
# the screen of this machine's bfloat16 path, if it has one (oneDNN's needs a layout onednn_gemv reads)
SCREEN = (greedy_head.greedy_head(linear_ops.prepack(torch.randn(64, 64).bfloat16()))
          if KERNELS is not None and linear_ops.bf16_path() != "torch" else None)
pytestmark = pytest.mark.skipif(
    SCREEN is None, reason="the screened head needs oneDNN-packed weights onednn_gemv reads and AVX-512 VNNI, "
                           "or linear_bf16 with AVX2")


def token_ids(llm: LLM, prompts, **params):
    llm.reset_prefix_cache()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, **params), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # an untied head, and a tied one
def test_greedy_steps_take_the_screened_head_and_keep_their_tokens(tiny_checkpoint, corpus_token_ids, arch):
    llm = LLM(tiny_checkpoint(arch), dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    model = llm.llm_engine.engine_core.engine_core.executor.model_runner.model
    assert model.greedy_token_rows == SCREEN.max_rows
    calls = []
    screen = model.greedy_tokens

    def counting(hidden):
        tokens = screen(hidden)
        calls.append(tokens is not None)
        return tokens

    model.greedy_tokens = counting
    prompts = [corpus_token_ids[i * 100:i * 100 + n] for i, n in enumerate((5, 7, 33, 60))]
    screened = token_ids(llm, prompts, temperature=0.0)
    assert sum(calls) >= 12  # every step of the batch (prefill's last tokens included) could use it
    calls.clear()
    with_logprobs = token_ids(llm, prompts, temperature=0.0, logprobs=2)  # not a plain greedy step
    assert not calls
    model.greedy_token_rows = 0  # the full logits for every step
    full = token_ids(llm, prompts, temperature=0.0)
    assert screened == full == with_logprobs


@pytest.mark.skipif(SCREEN is None or SCREEN.max_rows <= greedy_head.MAX_ROWS,
                    reason="steps of more than 8 rows take the greedy head on AMX tiles or oneDNN's 64-output blocks "
                           "only")
def test_greedy_steps_of_more_rows_than_the_screen_keep_their_tokens(tiny_checkpoint, corpus_token_ids):
    llm = LLM(tiny_checkpoint("qwen3"), dtype="bfloat16", max_model_len=256, max_num_seqs=16)
    model = llm.llm_engine.engine_core.engine_core.executor.model_runner.model
    rows = []
    head = model.greedy_tokens

    def counting(hidden):
        tokens = head(hidden)
        rows.append((hidden.shape[0], tokens is not None))
        return tokens

    model.greedy_tokens = counting
    prompts = [corpus_token_ids[i * 50:i * 50 + 3 + i] for i in range(12)]
    fused = token_ids(llm, prompts, temperature=0.0)
    assert sum(1 for n, named in rows if n == 12 and named) >= 10  # the batch's decode steps
    model.greedy_token_rows = 0
    assert fused == token_ids(llm, prompts, temperature=0.0)
