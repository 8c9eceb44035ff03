"""LoRA adapters in the offline engine: greedy ids equal transformers + peft (unmerged and merged), mixed
batches equal each request alone, the prefix cache keeps adapters apart, and bad adapters are refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core.errors import ConfigError, ValidationError
from quire.offline import LLM, LoRARequest, SamplingParams
from tests.gguf.greedy import transformers_greedy

from .conftest import write_adapter

PROMPT_LENS = (1, 5, 17, 40, 64, 100)
NUM_NEW_TOKENS = 16
FLOAT32_MIN_MARGIN = 1e-3
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[1000 + i * 300:1000 + i * 300 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def lora_llm(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True,
              max_loras=2, max_lora_rank=8, multiprocess=False)
    yield llm
    llm.shutdown()


def greedy(num_tokens=NUM_NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


def hf_reference(base_path, adapter_path, prompts, merged: bool):
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                      adapter_path)
    if merged:
        model = model.merge_and_unload()
    results = transformers_greedy(base_path, prompts, model=model, num_tokens=NUM_NEW_TOKENS)
    smallest = min(min(margins) for _, margins in results)
    assert smallest > FLOAT32_MIN_MARGIN, f"the adapter's greedy margins are not clear ({smallest:.2e})"
    return [ids for ids, _ in results]


def ids_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["qv", "all"])
def test_greedy_ids_equal_peft_and_the_merged_model(lora_llm, tiny_checkpoint, lora_adapters, prompts, name):
    base = tiny_checkpoint("llama")
    adapter = LoRARequest(name, 1 if name == "qv" else 3, str(lora_adapters(name)))
    unmerged = hf_reference(base, adapter.lora_path, prompts, merged=False)
    assert hf_reference(base, adapter.lora_path, prompts, merged=True) == unmerged
    got = ids_of(lora_llm.generate(prompts, greedy(), lora_request=adapter, use_tqdm=False))
    assert got == unmerged
    base_ids = ids_of(lora_llm.generate(prompts, greedy(), use_tqdm=False))
    assert sum(a != b for a, b in zip(base_ids, unmerged)) >= len(prompts) - 1, "the adapter changes little"


def test_a_mixed_batch_gives_each_request_its_ids_alone(lora_llm, lora_adapters, prompts):
    """The base model and two adapters in one batch (each prompt under all three)."""
    adapters = [None, LoRARequest("qv", 1, str(lora_adapters("qv"))), LoRARequest("qv2", 2, str(lora_adapters("qv2")))]
    alone = {}
    for index, adapter in enumerate(adapters):
        alone[index] = ids_of(lora_llm.generate(prompts, greedy(), lora_request=adapter, use_tqdm=False))
    batch_prompts = [p for p in prompts for _ in adapters]
    batch_adapters = [a for _ in prompts for a in adapters]
    mixed = ids_of(lora_llm.generate(batch_prompts, greedy(), lora_request=batch_adapters, use_tqdm=False))
    for i, ids in enumerate(mixed):
        assert ids == alone[i % len(adapters)][i // len(adapters)], f"request {i} differs from its run alone"
    assert alone[1] != alone[2] != alone[0]


def test_more_adapters_than_slots_take_turns(tiny_checkpoint, lora_adapters, prompts):
    """With one slot, requests for two adapters run one adapter at a time, and each still gets its ids."""
    qv, qv2 = (LoRARequest(name, i, str(lora_adapters(name))) for i, name in ((1, "qv"), (2, "qv2")))
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True,
              max_loras=1, max_lora_rank=8, multiprocess=False)
    try:
        expected = [ids_of(llm.generate(prompts[:3], greedy(), lora_request=a, use_tqdm=False)) for a in (qv, qv2)]
        mixed = ids_of(llm.generate(prompts[:3] * 2, greedy(), lora_request=[qv] * 3 + [qv2] * 3, use_tqdm=False))
    finally:
        llm.shutdown()
    assert mixed == expected[0] + expected[1]


def test_two_adapters_never_share_cached_blocks(lora_llm, lora_adapters, corpus_token_ids):
    prompt = corpus_token_ids[5000:5080]  # five full blocks of 16
    qv, qv2 = (LoRARequest(name, i, str(lora_adapters(name))) for i, name in ((1, "qv"), (2, "qv2")))

    def hits_of(adapter):
        before = lora_llm.get_metrics().scheduler.prefix_cache_hits
        lora_llm.generate([prompt], greedy(2), lora_request=adapter, use_tqdm=False)
        return lora_llm.get_metrics().scheduler.prefix_cache_hits - before

    lora_llm.llm_engine.reset_prefix_cache()
    assert hits_of(qv) == 0
    assert hits_of(qv2) == 0  # the same tokens under another adapter: nothing reused
    assert hits_of(None) == 0  # nor by the base model
    assert hits_of(qv) == 64  # the same adapter again: its first four blocks


def test_requests_name_adapters_the_engine_can_apply(tiny_checkpoint, lora_llm, lora_adapters, tmp_path, prompts):
    qv = str(lora_adapters("qv"))
    plain = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, multiprocess=False)
    try:
        with pytest.raises(ValidationError, match="enable_lora") as error:
            plain.generate(prompts[:1], greedy(), lora_request=LoRARequest("qv", 1, qv), use_tqdm=False)
        assert error.value.param == "lora_request"
    finally:
        plain.shutdown()
    cases = {
        "no adapter_config.json": tmp_path / "missing",
        "rank 16 is above max_lora_rank=8": write_adapter(tiny_checkpoint("llama"), tmp_path / "r16",
                                                           ("q_proj",), 4, rank=16),
        "use_dora=True is not supported": write_adapter(tiny_checkpoint("llama"), tmp_path / "dora",
                                                         ("q_proj",), 5, use_dora=True),
        "targets a module Quire does not apply LoRA to": write_adapter(tiny_checkpoint("llama"), tmp_path / "head",
                                                                        ("q_proj", "lm_head"), 6),
    }
    for number, (message, path) in enumerate(cases.items(), start=10):
        with pytest.raises(ValidationError, match=message):
            lora_llm.generate(prompts[:1], greedy(), lora_request=LoRARequest(f"bad{number}", number, str(path)),
                              use_tqdm=False)
    with pytest.raises(ValidationError, match="lora_int_id 1 already names adapter"):
        lora_llm.generate(prompts[:1], greedy(), lora_request=LoRARequest("other", 1, str(lora_adapters("qv2"))),
                          use_tqdm=False)


def test_an_adapter_of_another_base_model_is_refused(tiny_checkpoint, lora_llm, tmp_path, prompts):
    other = write_adapter(tiny_checkpoint("qwen3"), tmp_path / "qwen3-adapter", ("q_proj",), 7)
    with pytest.raises(ValidationError, match="does not fit the model"):
        lora_llm.generate(prompts[:1], greedy(), lora_request=LoRARequest("q3", 20, str(other)), use_tqdm=False)
    assert json.loads((other / "adapter_config.json").read_text())["r"] == 8


def test_lora_needs_a_llama_shaped_model_on_one_rank(tiny_checkpoint):
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        LLM(tiny_checkpoint("llama"), dtype="float32", enable_lora=True, tensor_parallel_size=2)
