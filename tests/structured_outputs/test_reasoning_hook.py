"""With a reasoning parser, a constraint waits for the thinking to end: it is off while the prompt leaves
the thinking open (a logit bias then wins over what the grammar would allow), and on from the first token
when the prompt already closed it (a template with thinking turned off)."""

from __future__ import annotations

import json

import pytest

from quire.core.sampling_params import SamplingParams, StructuredOutputsParams
from quire.core.structured_outputs.manager import _closed_in_prompt, _find_last
from quire.offline import LLM

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", multiprocess=False, reasoning_parser="qwen3")


def test_the_constraint_waits_for_the_end_of_the_thinking(llm):
    tokenizer = llm.get_tokenizer()
    start = tokenizer.encode("<think>", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    question = tokenizer.encode("Is os.getcwd stable?\n", add_special_tokens=False)
    letter = tokenizer.encode("z", add_special_tokens=False)[0]  # never the first token of a JSON object
    params = SamplingParams(temperature=0.0, max_tokens=24, logit_bias={letter: 100.0},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    thinking, closed = llm.generate([question + start, question + start + end], params, use_tqdm=False)
    assert thinking.outputs[0].token_ids[0] == letter  # still thinking: unconstrained
    assert json.loads(closed.outputs[0].text) in ({"ok": True}, {"ok": False})  # constrained from the start
    llm.llm_engine.check_idle_invariants()


def test_tag_search_helpers():
    assert _find_last([1, 2, 3, 1, 2], (1, 2)) == 3 and _find_last([1, 2], (3,)) == -1
    assert _closed_in_prompt([5, 1, 9, 2, 7], (1,), (2,)) and not _closed_in_prompt([2, 5, 1, 9], (1,), (2,))
    assert not _closed_in_prompt([5, 2], (1,), (2,))  # no start tag in the prompt: thinking may still begin
