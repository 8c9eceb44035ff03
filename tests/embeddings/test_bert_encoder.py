"""Quire's BERT encoder and pooling on all-MiniLM-L6-v2 against sentence-transformers, the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.models import get_model_entry
from quire.core.pooling_config import PoolingConfig, read_pooling_config
from quire.kernels.pooling import pool, truncate_and_normalize
from tests.embeddings.sentences import SENTENCES


@pytest.fixture(scope="module")
def folder(minilm_folder):
    return minilm_folder


@pytest.fixture(scope="module")
def pooling(folder) -> PoolingConfig:
    return read_pooling_config(folder)


@pytest.fixture(scope="module")
def token_ids(folder, pooling) -> list[list[int]]:
    """Each sentence's ids as sentence-transformers makes them: [CLS] … [SEP], cut to max_seq_length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(sentence, truncation=True, max_length=pooling.max_seq_length)["input_ids"]
            for sentence in SENTENCES]


def load(folder: str, dtype: str) -> torch.nn.Module:
    from quire.core.worker.model_runner import load_model

    return load_model(ModelConfig.from_hf(folder, dtype=dtype), None, torch.device("cpu"))


@pytest.fixture(scope="module")
def model(folder):
    return load(folder, "float32")


@pytest.fixture(scope="module")
def expected(sentence_transformers_vectors) -> torch.Tensor:
    return torch.from_numpy(sentence_transformers_vectors)


def embed(model, pooling: PoolingConfig, prompts: list[list[int]]) -> torch.Tensor:
    """One flat batch of ``prompts`` through the encoder, pooled and normalised as ``pooling`` says."""
    query_start_loc = [0]
    for prompt in prompts:
        query_start_loc.append(query_start_loc[-1] + len(prompt))
    input_ids = torch.tensor([token for prompt in prompts for token in prompt])
    positions = torch.cat([torch.arange(len(prompt)) for prompt in prompts])
    with torch.inference_mode():
        hidden = model(input_ids, positions, query_start_loc)
        pooled = pool(hidden, query_start_loc, pooling.pooling_type)
    return truncate_and_normalize(pooled, normalize=pooling.normalize)


def test_vectors_match_sentence_transformers(model, pooling, token_ids, expected):
    assert max(len(ids) for ids in token_ids) == pooling.max_seq_length == 256  # some sentences were cut
    assert sum(len(ids) == 256 for ids in token_ids) == 4
    vectors = embed(model, pooling, token_ids)
    cosine = torch.nn.functional.cosine_similarity(vectors, expected.float(), dim=-1)
    assert cosine.min() >= 0.9999, [(SENTENCES[i][:30], cosine[i].item()) for i in torch.argsort(cosine)[:3]]
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(len(SENTENCES)), rtol=0, atol=1e-5)


def test_one_flat_batch_equals_one_prompt_at_a_time(model, pooling, token_ids):
    batched = embed(model, pooling, token_ids)
    single = torch.cat([embed(model, pooling, [ids]) for ids in token_ids])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-6)


def test_token_types_change_the_vector(model, pooling, token_ids):
    prompt = token_ids[3]
    query_start_loc = [0, len(prompt)]
    input_ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        default = model(input_ids, positions, query_start_loc)
        zeros = model(input_ids, positions, query_start_loc, torch.zeros_like(input_ids))
        ones = model(input_ids, positions, query_start_loc, torch.ones_like(input_ids))
    torch.testing.assert_close(default, zeros, rtol=0, atol=0)
    assert not torch.allclose(default, ones)


def test_bfloat16_stays_close(folder, pooling, token_ids, expected):
    vectors = embed(load(folder, "bfloat16"), pooling, token_ids[:20])
    cosine = torch.nn.functional.cosine_similarity(vectors, expected[:20].float(), dim=-1)
    assert cosine.min() >= 0.999


def test_bad_offsets_are_refused(model):
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to the 3 tokens"):
        model(torch.tensor([101, 7592, 102]), torch.arange(3), [0, 0, 3])


def test_config_and_weight_names(folder, tmp_path):
    config = ModelConfig.from_hf(folder)
    assert (config.is_causal, config.layer_norm_eps, config.num_token_types, config.encoder_activation,
            config.max_model_len) == (False, 1e-12, 2, "gelu", 512)
    weights = get_model_entry("BertModel").weights
    assert weights.target("encoder.layer.2.attention.self.key.bias", config) == (
        "encoder.layer.2.attention.qkv_proj.bias", config.hidden_size)
    assert weights.target("bert.embeddings.LayerNorm.gamma", config) == ("embeddings.layer_norm.weight", 0)
    assert all(weights.is_skipped(name, config) for name in
               ("pooler.dense.weight", "embeddings.position_ids", "bert.pooler.dense.bias", "cls.predictions.bias"))
    config_path = tmp_path / "config.json"
    base = json.loads((Path(folder) / "config.json").read_text())
    for change, message in [({"hidden_act": "swish"}, "hidden_act 'swish' is not supported for BERT"),
                            ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
                            ({"is_decoder": True}, "is_decoder"),
                            ({"type_vocab_size": 0}, "type_vocab_size must be a positive integer, got 0")]:
        config_path.write_text(json.dumps({**base, **change}))
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf(tmp_path)
    config_path.write_text(json.dumps({**base, "hidden_act": "gelu_new"}))
    assert ModelConfig.from_hf(tmp_path).encoder_activation == "gelu_tanh"


def test_the_generating_engine_refuses_an_encoder(folder):
    from quire.offline import LLM

    with pytest.raises(ConfigError, match="BertModel is an encoder .* it cannot generate text"):
        LLM(str(folder), multiprocess=False, task="generate")
