"""The engine side of structured outputs on quire-demo: greedy constrained output does not depend on how
the request was scheduled (alone, batched with unconstrained requests, chunked, preempted, from the prefix
cache); grammars compile once and off the busy loop; a failing grammar fails its request only; the mask
never loosens (whitespace runs stay capped even when the logits push for blanks); logprobs stay the model's."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from quire.core.config import ModelConfig
from quire.core.demo import demo_model_path
from quire.core.engine_args import EngineArgs
from quire.core.errors import ValidationError
from quire.core.sampling_params import SamplingParams, StructuredOutputsParams
from quire.core.structured_outputs import backends
from quire.core.structured_outputs.backends import MAX_JSON_WHITESPACE
from quire.core.structured_outputs.xgrammar_backend import XGrammarBackend
from quire.core.worker.logits_processors import unpack_bitmask
from quire.offline import LLM

SCHEMA = {
    "type": "object",
    "properties": {
        "module": {"type": "string", "maxLength": 16},
        "functions": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "stable": {"type": "boolean"},
        "since": {"type": "integer", "minimum": 2, "maximum": 3},
    },
    "required": ["module", "functions", "stable"],
}
REGEX = r"[a-z]{3,8}(\.[a-z]{2,6}){1,2}\(\)"
QUESTIONS = ["Describe the json module.", "What does os.path.join do?",
             "Explain the difference between a list and a tuple in Python, with an example of each, and say "
             "when one should prefer a tuple over a list for storing records of data.",
             "Which module parses command-line options?", "What is a generator expression?",
             "Summarise what the collections module offers: counters, ordered dictionaries, default dictionaries, "
             "named tuples and double-ended queues, and what each one is for in everyday scripts."]


def conversation(i: int):
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def greedy(i: int) -> SamplingParams:
    constraint = StructuredOutputsParams(json=SCHEMA) if i % 2 == 0 else StructuredOutputsParams(regex=REGEX)
    return SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=constraint)


def check_valid(i: int, text: str) -> None:
    if i % 2 == 0:
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX, text), text


@pytest.fixture(scope="module")
def roomy():
    return LLM(dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def alone(roomy):
    """Each constrained request run by itself."""
    outputs = [roomy.chat(conversation(i), greedy(i), use_tqdm=False)[0].outputs[0] for i in range(len(QUESTIONS))]
    for i, output in enumerate(outputs):
        assert output.finish_reason == "stop", output
        check_valid(i, output.text)
    return [output.token_ids for output in outputs]


def test_batched_with_unconstrained_requests_and_from_the_prefix_cache(roomy, alone):
    n = len(QUESTIONS)
    conversations = [conversation(i) for i in range(n)] * 2
    params = [greedy(i) for i in range(n)] + [SamplingParams(temperature=1.0, seed=i, max_tokens=64)
                                              for i in range(n)]
    outputs = roomy.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:n]] == alone
    long_prompts = [o for o in outputs[:n] if len(o.prompt_token_ids) >= 32]
    assert len(long_prompts) >= 2 and all(o.num_cached_tokens >= 16 for o in long_prompts), \
        "the prompts did not hit the prefix cache"
    roomy.llm_engine.check_idle_invariants()


def test_chunked_prefill(alone):
    chunked = LLM(dtype="float32", max_num_batched_tokens=24, long_prefill_token_threshold=8,
                  enable_prefix_caching=False)
    outputs = chunked.chat([conversation(i) for i in range(len(QUESTIONS))],
                           [greedy(i) for i in range(len(QUESTIONS))], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    chunked.llm_engine.check_idle_invariants()


def test_preempted(alone):
    block_bytes = ModelConfig.from_hf(demo_model_path(), "float32").kv_bytes_per_token * 16
    tight = LLM(dtype="float32", max_model_len=192, kv_cache_memory=block_bytes * 16, enable_prefix_caching=False)
    outputs = tight.chat([conversation(i) for i in range(len(QUESTIONS))],
                         [greedy(i) for i in range(len(QUESTIONS))], use_tqdm=False)
    assert tight.llm_engine.scheduler_stats.num_preemptions >= 1, "the KV budget caused no preemption"
    assert [o.outputs[0].token_ids for o in outputs] == alone
    tight.llm_engine.check_idle_invariants()


def test_random_and_n_outputs_are_valid(roomy):
    constraint = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, n=3, max_tokens=128,
                            presence_penalty=0.5, logit_bias={10: 5.0}, structured_outputs=constraint)
    completions = roomy.chat(conversation(0), params, use_tqdm=False)[0].outputs
    assert len(completions) == 3
    for completion in completions:
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_whitespace_runs_stay_capped_when_the_logits_want_blanks(roomy):
    tokenizer = roomy.get_tokenizer()
    blanks = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).strip() == ""
              and tokenizer.decode([t]) != ""]
    assert blanks
    params = SamplingParams(temperature=0.0, max_tokens=200, logit_bias={t: 30.0 for t in blanks},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    output = roomy.chat(conversation(1), params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop", output.text
    jsonschema.validate(json.loads(output.text), SCHEMA)
    between = without_strings(output.text)
    runs = re.findall(r"[ \t\r\n]+", between)
    assert runs and max(len(run) for run in runs) <= MAX_JSON_WHITESPACE, output.text
    compact = SamplingParams(temperature=0.0, max_tokens=200, logit_bias={t: 30.0 for t in blanks},
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    text = roomy.chat(conversation(1), compact, use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert re.findall(r"\s+", without_strings(text)) == [], text


def without_strings(text: str) -> str:
    """JSON text with every string literal emptied (whitespace inside strings is content)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_logprobs_are_the_models_not_the_masked_ones(roomy):
    prompt = conversation(2)
    free = roomy.chat(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    constrained = roomy.chat(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5,
                                                    structured_outputs=StructuredOutputsParams(choice=["zzz"])),
                             use_tqdm=False)
    free_top = free[0].outputs[0].logprobs[0]
    constrained_top = constrained[0].outputs[0].logprobs[0]
    chosen = constrained[0].outputs[0].token_ids[0]
    assert chosen not in free_top or free_top[chosen].rank > 1  # the mask picked a token the model did not
    for token_id, logprob in free_top.items():
        assert constrained_top[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-5)
    assert constrained_top[chosen].logprob < max(lp.logprob for lp in free_top.values())


def test_grammars_compile_once_and_a_failure_fails_only_its_request(roomy):
    manager = roomy.llm_engine.engine_core.engine_core.structured_outputs
    compiled = manager.num_compiled
    regex = r"[0-9]{2,4}-unique-to-this-test"
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
    for _ in range(3):
        assert re.fullmatch(regex, roomy.generate("x", params, use_tqdm=False)[0].outputs[0].text)
    assert manager.num_compiled == compiled + 1
    # a constraint that passes the front end's check but fails to compile in the engine (simulated)
    broken = StructuredOutputsParams(regex="[a-z]+", backend="xgrammar")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(XGrammarBackend, "compile", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
        outputs = roomy.generate(["a", "b"], [SamplingParams(max_tokens=8, structured_outputs=broken),
                                             SamplingParams(max_tokens=8, temperature=0.0)], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].finish_reason == "length"
    roomy.llm_engine.check_idle_invariants()


class SlowCompile(XGrammarBackend):
    release = threading.Event()

    def compile(self, kind, spec, compact):
        assert SlowCompile.release.wait(30)
        return super().compile(kind, spec, compact)


def test_a_compiling_grammar_holds_up_only_its_own_request(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS.entries, "xgrammar", (__name__, "SlowCompile"))
    llm = LLM(dtype="float32")
    engine = llm.llm_engine
    slow = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    engine.add_request("slow", "Is it?", slow)
    engine.add_request("free", "The os module", SamplingParams(max_tokens=8, temperature=0.0))
    finished = {}
    deadline = time.monotonic() + 60
    while "free" not in finished and time.monotonic() < deadline:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "free" in finished and "slow" not in finished  # the free request ran while the grammar compiled
    SlowCompile.release.set()
    while "slow" not in finished and time.monotonic() < deadline:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["slow"].outputs[0].text in ("yes", "no")
    engine.check_idle_invariants()


def test_unpack_bitmask_matches_a_reference():
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=generator)
    unpacked = unpack_bitmask(bitmask, 150)
    for row in range(3):
        for token in range(150):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            assert bool(unpacked[row, token]) == bool((word >> (token % 32)) & 1)


def test_engine_args_offer_the_backend_option():
    config = EngineArgs(structured_outputs_backend="guidance").create_engine_config()
    assert config.structured_outputs_backend == "guidance"
    with pytest.raises(Exception, match="structured_outputs_backend"):
        EngineArgs(structured_outputs_backend="outlines").create_engine_config()
    with pytest.raises(ValidationError):
        StructuredOutputsParams(choice=["a"], backend="outlines")
