import json

import msgspec
import pytest

from quire.core import engine_args as engine_args_module
from quire.core.config import EngineConfig, ModelConfig, ParallelConfig
from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError

BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "eos_token_id": [5, 6],
}


def write(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return tmp_path


def test_transformers_4_layout(tmp_path):
    folder = write(tmp_path, rope_theta=500000.0, torch_dtype="bfloat16",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    config = ModelConfig.from_hf(folder)
    assert config.rope.theta == 500000.0 and config.rope.rope_type == "llama3"
    assert config.rope.factor == 8.0 and config.dtype == "bfloat16"
    assert config.head_dim == 16 and config.eos_token_ids == (5, 6)


def test_transformers_5_layout(tmp_path):
    folder = write(tmp_path, dtype="float32",
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0})
    config = ModelConfig.from_hf(folder)
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1234.0, "linear", 2.0)
    assert config.dtype == "float32"


def test_old_rope_scaling_type_key_and_generation_config_eos(tmp_path):
    folder = write(tmp_path, rope_theta=10.0, rope_scaling={"type": "linear", "factor": 3.0})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    config = ModelConfig.from_hf(folder)
    assert config.rope.rope_type == "linear" and config.eos_token_ids == (9,)


def test_architecture_specifics(tmp_path):
    qwen2 = ModelConfig.from_hf(write(tmp_path, architectures=["Qwen2ForCausalLM"]))
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(write(tmp_path, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    llama = ModelConfig.from_hf(write(tmp_path, attention_bias=True))
    assert llama.qkv_bias and llama.o_proj_bias


def test_dtype_and_max_model_len_choices(tmp_path):
    folder = write(tmp_path, torch_dtype="float16")
    assert ModelConfig.from_hf(folder).dtype == "bfloat16"  # fp16 checkpoints run in bf16 on CPU
    assert ModelConfig.from_hf(folder, dtype="fp32").dtype == "float32"
    assert ModelConfig.from_hf(folder, max_model_len=100).max_model_len == 100
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig.from_hf(folder, dtype="int8")
    with pytest.raises(ConfigError, match="max_model_len"):
        ModelConfig.from_hf(folder, max_model_len=513)


def test_mistral_sliding_window_is_read_and_no_longer_caps_the_context(tmp_path):
    folder = write(tmp_path, architectures=["MistralForCausalLM"], sliding_window=256)
    config = ModelConfig.from_hf(folder)
    assert config.max_model_len == 512 and config.sliding_window == 256
    assert config.layer_sliding_window(0) == config.layer_sliding_window(1) == 256


def test_clear_errors_for_unusable_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path / "missing")
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf(write(tmp_path, hidden_act="gelu"))


def test_data_parallel_size_is_validated_and_shares_out_the_threads(tmp_path, monkeypatch):
    folder = str(write(tmp_path))
    with pytest.raises(ConfigError, match="data_parallel_size must be at least 1"):
        EngineArgs(model=folder, data_parallel_size=0).create_engine_config()
    config = EngineArgs(model=folder, data_parallel_size=2, num_threads=5).create_engine_config()
    assert config.parallel == ParallelConfig(data_parallel_size=2, data_parallel_rank=0)
    assert config.num_threads == 2  # per engine core
    rank_1 = config.for_data_parallel_rank(1)
    assert rank_1.parallel == ParallelConfig(2, 1) and rank_1.model == config.model
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rank_1), type=EngineConfig) == rank_1
    monkeypatch.setattr(engine_args_module, "available_cpu_count", lambda: 6)
    assert EngineArgs(model=folder, data_parallel_size=4).create_engine_config().num_threads == 1
    assert EngineArgs(model=folder, data_parallel_size=8).create_engine_config().num_threads == 1
    assert EngineArgs(model=folder, data_parallel_size=3).create_engine_config().num_threads == 2
    single = EngineArgs(model=folder).create_engine_config()
    assert single.num_threads is None and single.parallel == ParallelConfig()


def test_data_parallel_engines_need_their_own_processes(tmp_path):
    from quire.core.engine.llm_engine import make_sync_client

    config = EngineArgs(model=str(write(tmp_path)), data_parallel_size=2).create_engine_config()
    with pytest.raises(ConfigError, match="data_parallel_size=2.*multiprocess=False"):
        make_sync_client(config, multiprocess=False)
