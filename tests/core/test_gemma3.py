"""Gemma 3 text models: config normalisation, and greedy ids equal to transformers' (alone, batched, chunked,
preempted) on a tiny checkpoint whose sliding window is shorter than most prompts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from quire.core.attention.torch_backend import TorchAttentionBackend
from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.worker.model_runner import load_model
from quire.offline import LLM, SamplingParams
from tests.core.reference import assert_bfloat16_agrees, hf_greedy_with_margins, hf_logits
from tests.core.test_transformers_equality import (
    FLOAT32_MIN_MARGIN,
    MAX_MODEL_LEN,
    NUM_NEW_TOKENS,
    PROMPT_LENS,
    run_quire,
)

SLIDING_WINDOW = 32
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention")
SEED = 2  # chosen so that transformers' float32 greedy margins stay clear (asserted)
LOGIT_STD = 5.0
LOGIT_SOFTCAP = 15.0  # tanh compresses the top logits by 10-20%
INIT_STD = 0.15


def build_gemma3_checkpoint(folder, tokenizer, sliding_window: int = SLIDING_WINDOW, seed: int = SEED,
                            tie_word_embeddings: bool = False, post_norm_gain: float = 1.0):
    """A 3-layer Gemma 3 (two sliding-window layers, then a full one) built by transformers, with every
    Gemma-specific option away from its neutral value: query_pre_attn_scalar != head_dim, logit soft-capping,
    linear rope scaling on the full layers only, a local rotary base, a hidden size whose square root bfloat16
    rounds; weights scaled so that logits are peaked. ``post_norm_gain``: about what the norms after attention
    and the MLP scale by (a tied head needs the layers' outputs to outweigh the scaled embeddings, or every
    step repeats its input token)."""
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Gemma3TextConfig(
        vocab_size=max(2048, len(tokenizer)), hidden_size=48, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
        sliding_window=sliding_window, layer_types=list(LAYER_TYPES), max_position_embeddings=1024,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=LOGIT_SOFTCAP, initializer_range=INIT_STD, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.1)  # Gemma's norms scale by 1 + weight: weights near 0
            if ".post_" in name:
                param.add_(post_norm_gain - 1.0)
        # the final norm leaves hidden states with RMS ~1: the logits' spread is about a head row's norm
        head = model.get_output_embeddings().weight
        head.mul_(LOGIT_STD / head.norm(dim=-1).mean())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id}))
    return folder


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 700:i * 700 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory, tiny_tokenizer):
    return build_gemma3_checkpoint(tmp_path_factory.mktemp("ckpt-gemma3"), tiny_tokenizer)


@pytest.fixture(scope="module")
def hf_reference(gemma3_checkpoint, prompts):
    """dtype -> per prompt: (transformers' greedy ids, top-1 minus top-2 logprob at each step)."""
    cache = {}

    def get(dtype):
        if dtype not in cache:
            model = AutoModelForCausalLM.from_pretrained(gemma3_checkpoint, dtype=getattr(torch, dtype))
            cache[dtype] = hf_greedy_with_margins(model, prompts, NUM_NEW_TOKENS)
            if dtype == "float32":
                smallest = min(min(margins) for _, margins in cache[dtype])
                assert smallest > FLOAT32_MIN_MARGIN, f"a greedy margin of {smallest:.2e} could flip on float noise"
        return cache[dtype]

    return get


def test_config_reads_the_gemma3_fields(gemma3_checkpoint):
    config = ModelConfig.from_hf(gemma3_checkpoint)
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.sliding_window, config.layer_types) == (SLIDING_WINDOW, LAYER_TYPES)
    assert [config.layer_sliding_window(i) for i in range(3)] == [SLIDING_WINDOW, SLIDING_WINDOW, None]
    assert (config.query_pre_attn_scalar, config.final_logit_softcapping) == (32.0, LOGIT_SOFTCAP)
    assert config.local_rope_theta == 10000.0
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1000000.0, "linear", 2.0)
    assert config.qk_norm and not config.tie_word_embeddings


# google/gemma-3-1b-it's config.json (transformers 4.50): no layer_types, no tie_word_embeddings (true by default),
# the rotary bases as rope_theta and rope_local_base_freq; the larger models add linear rope_scaling.
HUB_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
    "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
}


def _config_from(tmp_path, hf: dict) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return ModelConfig.from_hf(tmp_path)


def test_config_reads_the_hub_layout(tmp_path):
    config = _config_from(tmp_path, HUB_CONFIG)
    assert config.tie_word_embeddings and config.eos_token_ids == (1, 106)
    assert config.layer_types == tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26))
    assert (config.sliding_window, config.query_pre_attn_scalar, config.final_logit_softcapping) == (512, 256.0, None)
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1000000.0, "linear", 8.0)
    assert config.local_rope_theta == 10000.0
    assert config.max_model_len == 32768  # the window does not cap the context


@pytest.mark.parametrize(("change", "message"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention"] * 25 + ["chunked_attention"]}, "chunked_attention"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForCausalLM"),  # lists the supported ones
])
def test_config_refuses_what_the_model_cannot_run(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        _config_from(tmp_path, {**HUB_CONFIG, **change})


def test_transformers_reference_applies_the_window(gemma3_checkpoint, prompts):
    """The references below exercise windows: a longer window changes transformers' logits past it."""
    windowed = AutoModelForCausalLM.from_pretrained(gemma3_checkpoint, dtype=torch.float32)
    unwindowed = AutoModelForCausalLM.from_pretrained(gemma3_checkpoint, dtype=torch.float32, sliding_window=1024)
    first, second = hf_logits(windowed, prompts[-1]), hf_logits(unwindowed, prompts[-1])
    torch.testing.assert_close(first[:SLIDING_WINDOW], second[:SLIDING_WINDOW], rtol=0, atol=0)
    assert (first[SLIDING_WINDOW:] - second[SLIDING_WINDOW:]).abs().amax() > 1.0


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
def test_float32_greedy_equals_transformers(gemma3_checkpoint, hf_reference, prompts, mode):
    quire_ids = run_quire(gemma3_checkpoint, "float32", prompts, mode)
    for prompt, got, (expected, _) in zip(prompts, quire_ids, hf_reference("float32")):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "preempted"])
def test_bfloat16_greedy_matches_transformers_where_margins_are_clear(gemma3_checkpoint, hf_reference, prompts,
                                                                     mode):
    quire_ids = run_quire(gemma3_checkpoint, "bfloat16", prompts, mode)
    assert_bfloat16_agrees(prompts, quire_ids, hf_reference("bfloat16"), NUM_NEW_TOKENS)


def test_tied_embeddings_greedy_equals_transformers(tmp_path, tiny_tokenizer, prompts):
    """Gemma 3's default: the (unscaled) embedding table is the LM head. Larger post-norms keep the scaled
    embeddings from drowning the layers' outputs, which would make every step repeat its input token."""
    checkpoint = build_gemma3_checkpoint(tmp_path, tiny_tokenizer, seed=1, tie_word_embeddings=True,
                                         post_norm_gain=16.0)
    assert ModelConfig.from_hf(checkpoint).tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    reference = hf_greedy_with_margins(model, prompts, NUM_NEW_TOKENS)
    assert min(min(margins) for _, margins in reference) > FLOAT32_MIN_MARGIN
    quire_ids = run_quire(checkpoint, "float32", prompts, "batched")
    for prompt, got, (expected, _) in zip(prompts, quire_ids, reference):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"


def test_float32_prompt_logprobs_equal_transformers(gemma3_checkpoint, prompts):
    """Every position of the longest prompt, past the window too: the soft-capped logits themselves (greedy ids
    cannot show the cap, which keeps the order of the logits)."""
    prompt = prompts[-1]
    model = AutoModelForCausalLM.from_pretrained(gemma3_checkpoint, dtype=torch.float32)
    reference = hf_logits(model, prompt).log_softmax(-1)
    llm = LLM(gemma3_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    got = torch.tensor([out.prompt_logprobs[j][prompt[j]].logprob for j in range(1, len(prompt))])
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_bfloat16_embeddings_round_the_scale_like_transformers(gemma3_checkpoint, prompts):
    """sqrt(48) is 6.9375 in bfloat16, and transformers multiplies by that (not by 6.928...)."""
    config = ModelConfig.from_hf(gemma3_checkpoint, "bfloat16")
    model = load_model(config, TorchAttentionBackend("bfloat16"), torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(gemma3_checkpoint, dtype=torch.bfloat16)
    token_ids = torch.tensor(prompts[-1])
    assert torch.equal(model.embed_input_ids(token_ids), reference.get_input_embeddings()(token_ids[None])[0])


def test_triton_attention_backend_greedy_equals_transformers(gemma3_checkpoint, hf_reference, prompts):
    """The Triton backend's windowed and full paged attention side by side in one model (in Triton's interpreter
    on machines without a GPU, hence only two prompts longer than the window): chunked prompts, mixed batches,
    decodes."""
    long_prompts = prompts[-2:]
    quire_ids = run_quire(gemma3_checkpoint, "float32", long_prompts, "chunked", attention_backend="triton")
    for prompt, got, (expected, _) in zip(long_prompts, quire_ids, hf_reference("float32")[-2:]):
        assert got == expected, f"prompt of {len(prompt)} tokens differs"
