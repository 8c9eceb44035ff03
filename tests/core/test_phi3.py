"""Phi-3 checkpoints (q/k/v and gate/up fused in the checkpoint, LongRoPE, Phi-4-mini's partial rotary):
greedy ids equal transformers' alone, batched, chunked and preempted."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.testing.checkpoints import TinyModelSpec, build_checkpoint
from quire.offline import LLM
from tests.core.reference import assert_bfloat16_agrees, hf_greedy_with_margins
from tests.core.test_decode_stack import assert_stack_equals_modules, model_of
from tests.core.test_transformers_equality import (
    FLOAT32_MIN_MARGIN,
    MAX_MODEL_LEN,
    NUM_NEW_TOKENS,
    PROMPT_LENS,
    run_quire,
)

ORIGINAL_MAX = 128  # the LongRoPE checkpoints' original context; prompts reach past it
HEAD_DIM = 16  # TinyModelSpec's hidden_size 64 over 4 heads


def longrope(rotary_dim: int) -> dict:
    """Distinct factors per frequency, the long ones far from the short ones."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(rotary_dim // 2)],
            "long_factor": [1.0 + 2.0 * i for i in range(rotary_dim // 2)]}


# Seeds chosen so float32 greedy margins over the test prompts stay clear (asserted).
SPECS = {
    "phi3": TinyModelSpec(model_type="phi3", logit_std=4, seed=1),
    "phi3-longrope": TinyModelSpec(model_type="phi3", max_position_embeddings=512, rope_scaling=longrope(HEAD_DIM),
                                   extra_config={"original_max_position_embeddings": ORIGINAL_MAX}, logit_std=4,
                                   seed=3),
    # Phi-4-mini's shape: LongRoPE on the leading 3/4 of each head
    "phi4-mini": TinyModelSpec(model_type="phi3", max_position_embeddings=512, rope_scaling=longrope(12),
                               extra_config={"original_max_position_embeddings": ORIGINAL_MAX,
                                             "partial_rotary_factor": 0.75}, logit_std=4, seed=2),
}
# NOTE: transformers picks LongRoPE's factor list per forward call (long for every position once the sequence
# is longer than the original context); Quire's one table uses the long list iff max_model_len exceeds the
# original context. Prompts whose whole sequence fits the original context run with max_model_len = that
# context; longer prompts with the default, so both lists are compared and every comparison is like with like.
PROMPT_GROUPS = {
    "phi3": ((MAX_MODEL_LEN, PROMPT_LENS),),
    "phi3-longrope": ((ORIGINAL_MAX, (1, 17, 64, 96)), (MAX_MODEL_LEN, (129, 177, 256, 300))),
}
PROMPT_GROUPS["phi4-mini"] = PROMPT_GROUPS["phi3-longrope"]
CASES = [(name, max_model_len) for name, groups in PROMPT_GROUPS.items() for max_model_len, _ in groups]


def prompts_of(corpus_token_ids, lengths):
    return [corpus_token_ids[i * 700:i * 700 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def phi3_checkpoint(tmp_path_factory, tiny_tokenizer):
    """``phi3_checkpoint(name)`` → folder of the tiny float32 checkpoint ``SPECS[name]`` (built once)."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = build_checkpoint(tmp_path_factory.mktemp(f"ckpt-{name}"), SPECS[name], tiny_tokenizer)
        return built[name]

    return get


@pytest.fixture(scope="module")
def hf_reference(phi3_checkpoint, corpus_token_ids):
    """(name, dtype, max_model_len) → (prompts, ``hf_greedy_with_margins`` of them); float32 margins asserted."""
    cache = {}

    def get(name, dtype, max_model_len):
        if (name, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(phi3_checkpoint(name), dtype=getattr(torch, dtype))
            cache[name, dtype] = {}
            for group_len, lengths in PROMPT_GROUPS[name]:
                prompts = prompts_of(corpus_token_ids, lengths)
                results = hf_greedy_with_margins(model, prompts, NUM_NEW_TOKENS)
                if dtype == "float32":
                    smallest = min(min(margins) for _, margins in results)
                    assert smallest > FLOAT32_MIN_MARGIN, (
                        f"{name} checkpoint not peaked enough: a greedy margin of {smallest:.2e} could flip on "
                        "float noise; pick another seed or a larger logit_std")
                cache[name, dtype][group_len] = (prompts, results)
        return cache[name, dtype][max_model_len]

    return get


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
@pytest.mark.parametrize(("name", "max_model_len"), CASES)
def test_float32_greedy_equals_transformers(phi3_checkpoint, hf_reference, name, max_model_len, mode):
    prompts, reference = hf_reference(name, "float32", max_model_len)
    quire_ids = run_quire(phi3_checkpoint(name), "float32", prompts, mode, max_model_len=max_model_len)
    for prompt, got, (expected, _) in zip(prompts, quire_ids, reference):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
@pytest.mark.parametrize(("name", "max_model_len"), CASES)
def test_bfloat16_greedy_matches_transformers_where_margins_are_clear(
        phi3_checkpoint, hf_reference, name, max_model_len, mode):
    prompts, reference = hf_reference(name, "bfloat16", max_model_len)
    quire_ids = run_quire(phi3_checkpoint(name), "bfloat16", prompts, mode, max_model_len=max_model_len)
    assert_bfloat16_agrees(prompts, quire_ids, reference, NUM_NEW_TOKENS)


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-mini"])
def test_longrope_factors_decide_the_reference_ids(phi3_checkpoint, hf_reference, name):
    """Without its factor lists the checkpoint would generate other ids, for both groups of prompts: so the
    equality tests above would fail if either list were ignored."""
    config = AutoConfig.from_pretrained(phi3_checkpoint(name))
    num_factors = len(config.rope_parameters["short_factor"])
    config.rope_parameters.update(short_factor=[1.0] * num_factors, long_factor=[1.0] * num_factors)
    model = AutoModelForCausalLM.from_pretrained(phi3_checkpoint(name), config=config, dtype=torch.float32)
    for max_model_len, _ in PROMPT_GROUPS[name]:
        prompts, reference = hf_reference(name, "float32", max_model_len)
        plain = hf_greedy_with_margins(model, prompts, NUM_NEW_TOKENS)
        assert [ids for ids, _ in plain] != [ids for ids, _ in reference], f"max_model_len {max_model_len}"


def test_decode_stack_runs_whole_head_rotary_only(phi3_checkpoint, corpus_token_ids):
    """The C++ decoder stack (here on int8 weights, which any CPU stacks) rotates whole heads: it serves Phi-3,
    bit for bit as the modules do, and is left out for Phi-4-mini's partial rotary."""
    options = dict(dtype="bfloat16", quantization="int8", max_model_len=256, max_num_seqs=8)
    assert_stack_equals_modules(LLM(phi3_checkpoint("phi3-longrope"), **options), corpus_token_ids)
    assert model_of(LLM(phi3_checkpoint("phi4-mini"), **options)).decode_stack is None


def test_config_reads_longrope_and_partial_rotary(phi3_checkpoint):
    config = ModelConfig.from_hf(phi3_checkpoint("phi4-mini"), "float32")
    rope = config.rope
    assert (config.architecture, rope.rope_type, rope.original_max_position_embeddings) == (
        "Phi3ForCausalLM", "longrope", ORIGINAL_MAX)
    assert rope.short_factor == tuple(longrope(12)["short_factor"])
    assert rope.long_factor == tuple(longrope(12)["long_factor"])
    assert rope.rotary_dim(config.head_dim) == 12
    # transformers' default: sqrt(1 + ln(512 / 128) / ln(128))
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(128)))
    assert (config.qkv_bias, config.o_proj_bias, config.qk_norm, config.sliding_window) == (False, False, False, None)


def _write_config(folder, **changes):
    base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "original_max_position_embeddings": 128, "sliding_window": 2047}
    config = {key: value for key, value in {**base, **changes}.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_config_reads_phi3_hub_layout(tmp_path):
    """transformers 4.x's layout: ``rope_scaling`` of type ``su`` with the original context and the partial
    rotary factor at the top level; the sliding window kept."""
    config = ModelConfig.from_hf(_write_config(
        tmp_path, partial_rotary_factor=0.75, rope_scaling={"type": "su", "short_factor": [1.5] * 6,
                                                           "long_factor": [3.0] * 6, "attention_factor": 1.25}))
    assert (config.rope.rope_type, config.rope.attention_factor, config.rope.partial_rotary_factor) == (
        "longrope", 1.25, 0.75)
    assert config.sliding_window == 2047


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"original_max_position_embeddings": None, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                                  "long_factor": [1.0] * 8}},
     "original_max_position_embeddings"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}}, "short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "long_factor"),
    ({"partial_rotary_factor": 0.7}, "partial_rotary_factor"),
    ({"hidden_act": "gelu_new"}, "hidden_act"),
])
def test_config_refuses_what_the_model_cannot_run(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_write_config(tmp_path, **changes))
