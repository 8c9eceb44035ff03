"""GGUF files through the engine: greedy ids equal transformers' on the same file, in every weight type."""

from __future__ import annotations

import logging

import pytest

from quire.core.config import ModelConfig
from quire.offline import LLM, SamplingParams
from tests.core.test_decode_stack import assert_stack_equals_modules
from tests.gguf.greedy import NUM_NEW_TOKENS, assert_greedy_agrees, transformers_greedy

PROMPT_LENS = (1, 3, 17, 40, 64, 100, 150, 200)

CASES = [("llama", qtype) for qtype in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")]
CASES += [("qwen2", "Q4_0"), ("qwen2", "Q6_K"), ("qwen3", "F16"), ("qwen3", "Q8_0"), ("qwen3", "Q4_K")]


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return [corpus_token_ids[i * 500:i * 500 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.mark.parametrize(("arch", "qtype"), CASES)
def test_greedy_ids_equal_transformers_on_the_same_file(gguf_file, prompts, arch, qtype):
    path = gguf_file(arch, qtype)
    reference = transformers_greedy(path, prompts)
    llm = LLM(str(path), max_model_len=256)
    assert llm.llm_engine.model_config.dtype == "float32"
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_agrees([o.outputs[0].token_ids for o in outputs], reference, prompts)


def test_quantized_weights_stay_quantized_in_memory(gguf_file):
    llm = LLM(str(gguf_file("llama", "Q4_K")), max_model_len=256)
    model = llm.llm_engine.engine_core.engine_core.executor.model_runner.model  # in-process engine core
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None
    assert [w.qtype for w in layer.self_attn.qkv_proj.quantized] == ["Q4_K"]
    assert [w.qtype for w in layer.mlp.gate_up_proj.quantized] == ["Q4_K"]


def test_a_fused_projection_of_mixed_types_as_in_q4_k_m_files(gguf_file, prompts):
    """Q4_K_M files store some attn_v and ffn_down tensors in Q6_K: q/k/v become two segments."""
    mixed = {"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "blk.1.ffn_up.weight": "Q8_0"}
    path = gguf_file("llama", "Q4_K", tensor_types=mixed)
    llm = LLM(str(path), max_model_len=256)
    model = llm.llm_engine.engine_core.engine_core.executor.model_runner.model
    assert [w.qtype for w in model.model.layers[0].self_attn.qkv_proj.quantized] == ["Q4_K", "Q6_K"]
    assert [w.qtype for w in model.model.layers[1].mlp.gate_up_proj.quantized] == ["Q4_K", "Q8_0"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert_greedy_agrees([o.outputs[0].token_ids for o in outputs], transformers_greedy(path, prompts), prompts)


def test_decode_stack_on_mixed_quantized_types_equals_modules(gguf_file, corpus_token_ids):
    """Decode steps run every layer in one C++ call, on the same kernels as the modules: bit-identical, with a
    qkv bias (qwen2) and a projection of two types."""
    path = gguf_file("qwen2", "Q4_1", tensor_types={"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_up.weight": "Q8_0"})
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8)
    qkv = llm.llm_engine.engine_core.engine_core.executor.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert [w.qtype for w in qkv.quantized] == ["Q4_1", "Q6_K"] and qkv.bias is not None
    assert_stack_equals_modules(llm, corpus_token_ids)


def test_types_without_a_kernel_are_dequantized_at_load_with_a_log_line(gguf_file, prompts, caplog):
    path = gguf_file("qwen2", "Q5_0")
    with caplog.at_level(logging.INFO, logger="quire.core.models.gguf"):
        llm = LLM(str(path), max_model_len=256)
    assert any("Q5_0" in r.getMessage() and "dequantized to float at load" in r.getMessage()
               for r in caplog.records)
    outputs = llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert_greedy_agrees([o.outputs[0].token_ids for o in outputs], transformers_greedy(path, prompts[:4]),
                         prompts[:4])


def test_config_tokenizer_and_chat_template_come_from_the_metadata(gguf_file, gguf_source, tiny_tokenizer):
    path = gguf_file("qwen3", "Q8_0")
    config = ModelConfig.from_path(path)
    source = ModelConfig.from_hf(gguf_source("qwen3"))
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope",
                  "tie_word_embeddings", "qkv_bias", "o_proj_bias", "qk_norm", "eos_token_ids"):
        assert getattr(config, field) == getattr(source, field), field
    assert config.rms_norm_eps == pytest.approx(source.rms_norm_eps)  # GGUF stores it as a float32
    # a folder holding one GGUF file names it
    assert ModelConfig.from_path(path.parent).path == str(path)
    llm = LLM(str(path), max_model_len=256)
    tokenizer = llm.get_tokenizer()
    text = "def parse(self, value):\n    return value"
    assert tokenizer.encode(text) == tiny_tokenizer.encode(text)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert chat.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_option_points_at_a_hugging_face_folder(gguf_file, gguf_source):
    path = gguf_file("llama", "Q8_0")
    llm = LLM(str(path), tokenizer=str(gguf_source("llama")), max_model_len=256)
    out = llm.generate(["def main():"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
