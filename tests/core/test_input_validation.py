"""Bad input is refused before it reaches the engine, with an error that names the field."""

import pytest

from quire.core.errors import ConfigError, ValidationError
from quire.offline import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("prompt,param,message", [
    ("", "prompt", "empty"),
    ([[]], "prompt", "empty"),
    ([1, 2, 2048], "prompt", "out of vocabulary"),
    ([-1], "prompt", "out of vocabulary"),
    (list(range(64)), "prompt", "maximum context length is 64 tokens"),
    ({"text": "x"}, "prompt", "prompt_token_ids"),
    ([3.5], "prompt", "string or a list of token ids"),
    (3.5, "prompts", "list of prompts"),
])
def test_bad_prompts(llm, prompt, param, message):
    with pytest.raises(ValidationError, match=message) as info:
        llm.generate(prompt, use_tqdm=False)
    assert info.value.param == param
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_sampling_parameters(llm):
    with pytest.raises(ValidationError) as info:
        llm.generate("x", SamplingParams(stop_token_ids=[5000]), use_tqdm=False)
    assert info.value.param == "stop_token_ids"
    with pytest.raises(ValidationError) as info:
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert info.value.param == "sampling_params"
    with pytest.raises(ValidationError) as info:
        llm.generate("x", SamplingParams(max_tokens=None, min_tokens=80), use_tqdm=False)
    assert info.value.param == "min_tokens"


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValidationError):
        llm.generate(["fine", "", "also fine"], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("after", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason == "length"


def test_engine_configuration_errors(llama_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        LLM(llama_checkpoint, kv_cache_memory=1000)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(llama_checkpoint, max_num_seqs=0)
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(tmp_path)
