"""Sliding-window attention end to end, on a tiny Mistral checkpoint whose window (32 tokens) is shorter than
most prompts: the config is read as transformers reads it, greedy ids equal transformers' (alone, batched,
chunked, preempted), and a long request's KV blocks stop growing past the window."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core.attention.torch_backend import TorchAttentionBackend
from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.testing.checkpoints import TinyModelSpec, build_checkpoint
from quire.core.worker.kv_cache import blocks_per_sequence
from quire.core.worker.model_runner import load_model
from quire.offline import LLM, SamplingParams
from tests.core.reference import assert_bfloat16_agrees
from tests.core.test_transformers_equality import (
    FLOAT32_MIN_MARGIN,
    MAX_MODEL_LEN,
    NUM_NEW_TOKENS,
    PROMPT_LENS,
)

WINDOW = 32
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def mistral_checkpoint(tmp_path_factory, tiny_tokenizer):
    spec = TinyModelSpec(model_type="mistral", logit_std=4, seed=0, extra_config={"sliding_window": WINDOW})
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-mistral-window"), spec, tiny_tokenizer)


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 700:i * 700 + n] for i, n in enumerate(PROMPT_LENS)]


def hf_greedy(model, prompt, num_new_tokens=NUM_NEW_TOKENS):
    """transformers' greedy ids and, at each step, the top-1 minus top-2 logprob."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    top2 = torch.stack(out.scores)[:, 0].float().log_softmax(-1).topk(2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


@pytest.fixture(scope="module")
def hf_reference(mistral_checkpoint, prompts):
    """dtype -> per prompt: (greedy ids, margins), from transformers with the checkpoint's window."""
    cache = {}

    def get(dtype):
        if dtype not in cache:
            model = AutoModelForCausalLM.from_pretrained(mistral_checkpoint, dtype=getattr(torch, dtype))
            assert model.config.sliding_window == WINDOW
            cache[dtype] = [hf_greedy(model, prompt) for prompt in prompts]
            if dtype == "float32":
                smallest = min(min(margins) for _, margins in cache[dtype])
                assert smallest > FLOAT32_MIN_MARGIN, f"checkpoint not peaked enough: margin {smallest:.2e}"
        return cache[dtype]

    return get


def greedy_params(max_tokens=NUM_NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def bytes_per_block(checkpoint, dtype="float32"):
    return ModelConfig.from_hf(checkpoint, dtype).kv_bytes_per_token * BLOCK_SIZE


def write_config(folder, **fields):
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
    (folder / "config.json").write_text(json.dumps({**base, **fields}))
    return ModelConfig.from_hf(folder)


def test_windows_are_read_as_transformers_reads_them(tmp_path):
    mistral = write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=64,
                           layer_types=["full_attention"] * 4)  # MistralModel ignores layer_types
    assert [mistral.layer_sliding_window(i) for i in range(4)] == [64] * 4
    assert mistral.kv_cache_sliding_window == 64 and mistral.max_model_len == 512
    assert write_config(tmp_path, architectures=["MistralForCausalLM"]).sliding_window == 4096  # the default
    assert not write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=None).has_sliding_window
    # a window that can never slide within max_model_len is no window
    short = write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=512)
    assert not short.has_sliding_window and short.kv_cache_sliding_window is None
    # Qwen2/Qwen3: the window only with use_sliding_window, on layers max_window_layers and above
    assert not write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=64).has_sliding_window
    qwen2 = write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=True,
                         max_window_layers=2)
    assert [qwen2.layer_sliding_window(i) for i in range(4)] == [None, None, 64, 64]
    assert qwen2.kv_cache_sliding_window is None  # hybrid: no block is ever released
    qwen3 = write_config(tmp_path, architectures=["Qwen3ForCausalLM"], sliding_window=64, use_sliding_window=True,
                         layer_types=["sliding_attention", "full_attention"] * 2)
    assert [qwen3.layer_sliding_window(i) for i in range(4)] == [64, None, 64, None]
    assert not write_config(tmp_path, architectures=["LlamaForCausalLM"], sliding_window=64).has_sliding_window
    with pytest.raises(ConfigError, match="layer_types"):
        write_config(tmp_path, architectures=["Qwen3ForCausalLM"], sliding_window=64, use_sliding_window=True,
                     layer_types=["sliding_attention"])
    with pytest.raises(ConfigError, match="sliding_window"):
        write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=0)


def test_the_reference_applies_the_window(mistral_checkpoint, prompts, hf_reference):
    """Without its window, transformers' model generates other ids for most prompts: the equality tests
    below would notice a Quire that ignored the window."""
    unwindowed = AutoModelForCausalLM.from_pretrained(mistral_checkpoint, dtype=torch.float32, sliding_window=None)
    differing = [hf_greedy(unwindowed, prompt)[0] != expected
                 for prompt, (expected, _) in zip(prompts, hf_reference("float32"))]
    assert sum(differing) >= 6


def run_quire(checkpoint, dtype, prompts, mode, **engine_options):
    kwargs = dict(dtype=dtype, max_model_len=MAX_MODEL_LEN, **engine_options)
    if mode in ("chunked", "preempted-chunked"):
        kwargs["max_num_batched_tokens"] = 64
    if mode == "preempted":  # one full-length sequence and the null block, as in test_transformers_equality
        kwargs["kv_cache_memory"] = bytes_per_block(checkpoint, dtype) * (MAX_MODEL_LEN // BLOCK_SIZE + 1)
    if mode == "preempted-chunked":  # the least a windowed model allows: far less than one whole sequence
        config = ModelConfig.from_hf(checkpoint, dtype, MAX_MODEL_LEN)
        num_blocks = blocks_per_sequence(config, BLOCK_SIZE, 64) + 1
        assert num_blocks < MAX_MODEL_LEN // BLOCK_SIZE
        kwargs["kv_cache_memory"] = bytes_per_block(checkpoint, dtype) * num_blocks
    llm = LLM(checkpoint, **kwargs)
    if mode == "alone":
        outputs = [llm.generate([p], greedy_params(), use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    if mode.startswith("preempted"):
        assert llm.llm_engine.scheduler_stats.num_preemptions > 0, "the KV budget caused no preemption"
    llm.llm_engine.check_idle_invariants()  # every released block came back exactly once
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted", "preempted-chunked"])
def test_float32_greedy_equals_transformers(mistral_checkpoint, hf_reference, prompts, mode):
    quire_ids = run_quire(mistral_checkpoint, "float32", prompts, mode)
    for prompt, got, (expected, _) in zip(prompts, quire_ids, hf_reference("float32")):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"


def test_bfloat16_greedy_matches_transformers_where_margins_are_clear(mistral_checkpoint, hf_reference, prompts):
    quire_ids = run_quire(mistral_checkpoint, "bfloat16", prompts, "chunked")
    assert_bfloat16_agrees(prompts, quire_ids, hf_reference("bfloat16"), NUM_NEW_TOKENS)


def test_blocks_held_by_a_long_request_stop_growing_past_the_window(mistral_checkpoint, corpus_token_ids):
    prompt, num_new_tokens = corpus_token_ids[9000:9040], 250
    llm = LLM(mistral_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN)
    engine = llm.llm_engine
    manager = engine.engine_core.engine_core.scheduler.kv_cache_manager
    engine.add_request("long", {"prompt_token_ids": prompt}, greedy_params(num_new_tokens))
    held, listed, in_use, token_ids = [], [], [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = output.outputs[0].token_ids
        if "long" in manager.req_to_blocks:
            listed.append(len(manager.get_block_ids("long")))
            held.append(listed[-1] - manager.num_released_blocks("long"))
            in_use.append(manager.block_pool.num_blocks - 1 - manager.num_free_blocks)
    # the table covers every token: last seen after the step that computed position len + new - 3 (the next
    # step, computing the last position, finished the request)
    assert listed[-1] == -(-(len(prompt) + num_new_tokens - 2) // BLOCK_SIZE) == 18
    # a decode sees 32 keys, which span at most 3 blocks of 16; the 40-token prompt took 3 as well
    assert max(held) == 3 and in_use == held  # the released blocks are back in the pool
    model = AutoModelForCausalLM.from_pretrained(mistral_checkpoint, dtype=torch.float32)
    expected, margins = hf_greedy(model, prompt, num_new_tokens)
    assert min(margins) > FLOAT32_MIN_MARGIN
    assert list(token_ids) == expected


def test_prefix_cache_hits_past_the_window(mistral_checkpoint, prompts, hf_reference):
    """A repeated 300-token prompt takes its cached blocks back, except those before its last token's window
    (never taken), and generates the same ids."""
    llm = LLM(mistral_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN)
    expected = hf_reference("float32")[-1][0]
    first, second = (llm.generate([prompts[-1]], greedy_params(), use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 288
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    llm.llm_engine.check_idle_invariants()


def test_triton_attention_backend_greedy_equals_transformers(mistral_checkpoint, hf_reference, prompts):
    """The Triton kernels' windows (in Triton's interpreter on machines without a GPU, hence only the two
    longest prompts; tests/kernels/triton_ops covers the windowed kernels case by case), chunked."""
    long_prompts = prompts[-2:]
    quire_ids = run_quire(mistral_checkpoint, "float32", long_prompts, "chunked", attention_backend="triton")
    for prompt, got, (expected, _) in zip(long_prompts, quire_ids, hf_reference("float32")[-2:]):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"


class NoWindowBackend(TorchAttentionBackend):
    name = "torch-without-windows"

    def __init__(self, dtype="float32", device="cpu"):
        super().__init__(dtype, device)
        self.capabilities = dataclasses.replace(self.capabilities, supports_sliding_window=False)


def test_backends_without_windows_refuse_windowed_models_at_start_up(mistral_checkpoint):
    config = ModelConfig.from_hf(mistral_checkpoint, "float32", MAX_MODEL_LEN)
    with pytest.raises(ConfigError, match="sliding-window attention.*'torch-without-windows'"):
        load_model(config, NoWindowBackend(), torch.device("cpu"))
    # a window the context never outgrows is no window: nothing to refuse
    load_model(dataclasses.replace(config, max_model_len=WINDOW), NoWindowBackend(), torch.device("cpu"))


def test_windowed_models_keep_off_the_decoder_stack(mistral_checkpoint):
    config = ModelConfig.from_hf(mistral_checkpoint, "bfloat16", MAX_MODEL_LEN)
    model = load_model(config, TorchAttentionBackend("bfloat16", "cpu"), torch.device("cpu"))
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [WINDOW] * config.num_hidden_layers
    assert model.model.decode_stack is None
