"""Pooling requests through the engine: ``LLM.embed`` / ``LLM.score`` on all-MiniLM-L6-v2 against
sentence-transformers, and a tiny Qwen3 with last-token (and mean) pooling against ``transformers``."""

from __future__ import annotations

import numpy as np
import pytest

from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError, ValidationError
from quire.core.pooling_params import PoolingParams
from quire.core.sampling_params import SamplingParams
from tests.embeddings.sentences import SENTENCES


def vectors(outputs) -> np.ndarray:
    return np.array([output.outputs.embedding for output in outputs], dtype=np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embed_matches_sentence_transformers(minilm_llm, sentence_transformers_vectors):
    outputs = minilm_llm.embed(SENTENCES, truncate_prompt_tokens=-1, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outputs].count(256) == 4  # the long ones were cut to 256 tokens
    found = vectors(outputs)
    similarity = cosines(found, sentence_transformers_vectors)
    assert similarity.min() >= 0.9999, [(SENTENCES[i][:30], similarity[i]) for i in np.argsort(similarity)[:3]]
    np.testing.assert_allclose(np.linalg.norm(found, axis=-1), 1.0, rtol=0, atol=1e-5)
    assert all(o.finished and o.finish_reason == "stop" for o in outputs)


def test_a_batch_of_32_equals_32_single_requests(minilm_llm):
    batch = vectors(minilm_llm.embed(SENTENCES[:32], truncate_prompt_tokens=-1, use_tqdm=False))
    single = np.concatenate([vectors(minilm_llm.embed(s, truncate_prompt_tokens=-1, use_tqdm=False))
                             for s in SENTENCES[:32]])
    np.testing.assert_allclose(batch, single, rtol=0, atol=1e-6)


def test_dimensions_and_normalize(minilm_llm, sentence_transformers_model):
    sentences = SENTENCES[3:8]
    raw = vectors(minilm_llm.embed(sentences, PoolingParams(normalize=False), use_tqdm=False))
    # the mean of the oracle's token embeddings (its Normalize module is part of the model)
    tokens = sentence_transformers_model.encode(sentences, output_value="token_embeddings")
    expected_raw = np.stack([t.float().mean(0).numpy() for t in tokens])
    assert np.abs(np.linalg.norm(raw, axis=-1) - 1).min() > 0.01
    np.testing.assert_allclose(raw, expected_raw, rtol=0, atol=1e-4)
    short = vectors(minilm_llm.embed(sentences, PoolingParams(dimensions=64), use_tqdm=False))
    assert short.shape == (5, 64)
    np.testing.assert_allclose(np.linalg.norm(short, axis=-1), 1.0, rtol=0, atol=1e-5)
    # Matryoshka: the first 64 values of the pooled vector, normalised afterwards
    cut = raw[:, :64] / np.linalg.norm(raw[:, :64], axis=-1, keepdims=True)
    np.testing.assert_allclose(short, cut, rtol=0, atol=1e-6)
    # requests of one step with different options (each pooled on its own)
    mixed = minilm_llm.embed(sentences[:2], [PoolingParams(dimensions=64), PoolingParams(normalize=False)],
                             use_tqdm=False)
    np.testing.assert_allclose(mixed[0].outputs.embedding, short[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(mixed[1].outputs.embedding, raw[1], rtol=0, atol=1e-6)


def test_score_is_the_cosine_of_the_embeddings(minilm_llm):
    query = "How do I reset my password?"
    documents = ["To reset your password, open the account settings page.", "Bananas are yellow."]
    scores = minilm_llm.score(query, documents, use_tqdm=False)
    found = vectors(minilm_llm.embed([query, *documents], use_tqdm=False))
    assert [s.outputs.score for s in scores] == pytest.approx(list(cosines(found[:1], found[1:])), abs=1e-6)
    assert scores[0].outputs.score > scores[1].outputs.score + 0.2
    pairs = minilm_llm.score(documents, documents, use_tqdm=False)  # N against N: each text with itself
    assert [p.outputs.score for p in pairs] == pytest.approx([1.0, 1.0], abs=1e-5)
    with pytest.raises(ValidationError) as error:
        minilm_llm.score(documents, [query] * 3, use_tqdm=False)
    assert error.value.param == "text_2"


def test_bad_embedding_requests_name_the_field(minilm_llm):
    for prompt, param in [("", "prompt"), ([[]], "prompt"), ("word " * 600, "prompt")]:
        with pytest.raises(ValidationError) as error:
            minilm_llm.embed(prompt, use_tqdm=False)
        assert error.value.param == param, prompt
    with pytest.raises(ValidationError, match="maximum context length is 256 tokens") as error:
        minilm_llm.embed("word " * 600, use_tqdm=False)
    assert error.value.code == "context_length_exceeded"
    cut = minilm_llm.embed("word " * 600, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 10 and cut.prompt_token_ids[-1] == 102  # [SEP] kept, as the tokenizer cuts
    with pytest.raises(ValidationError) as error:
        minilm_llm.embed("hello", PoolingParams(dimensions=385), use_tqdm=False)
    assert error.value.param == "dimensions"
    with pytest.raises(ValidationError) as error:
        PoolingParams(dimensions=0)
    assert error.value.param == "dimensions"
    with pytest.raises(ValidationError, match="does not generate text") as error:
        minilm_llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert error.value.param == "model"
    minilm_llm.llm_engine.check_idle_invariants()


def test_the_task_comes_from_the_folder_or_the_options(minilm_folder, tiny_checkpoint):
    assert EngineArgs(model=minilm_folder).create_engine_config().task == "embed"
    qwen3 = tiny_checkpoint("qwen3")
    assert EngineArgs(model=qwen3).create_engine_config().task == "generate"
    config = EngineArgs(model=qwen3, task="embed").create_engine_config()
    assert (config.task, config.pooling.pooling_type, config.pooling.normalize) == ("embed", "last", True)
    config = EngineArgs(model=minilm_folder, pooler_config={"pooling_type": "CLS", "normalize": False}
                        ).create_engine_config()
    assert (config.pooling.pooling_type, config.pooling.normalize, config.model.max_model_len) == ("cls", False, 256)
    assert config.scheduler.whole_prompts and config.scheduler.max_num_batched_tokens >= 256
    for options, message in [({"pooler_config": {"pooling": "mean"}}, "unknown key 'pooling'"),
                             ({"pooler_config": {"pooling_type": "max"}}, "pooling_type must be one of"),
                             ({"pooler_config": {"normalize": "yes"}}, "normalize must be true or false"),
                             ({"task": "embed", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                              "speculative_config does not apply to pooling models")]:
        with pytest.raises(ConfigError, match=message):
            EngineArgs(model=minilm_folder, **options).create_engine_config()
    with pytest.raises(ConfigError, match="pooler_config applies to embedding models"):
        EngineArgs(model=qwen3, pooler_config={"normalize": True}).create_engine_config()


def test_an_embedding_request_to_a_generative_engine_names_the_model():
    from quire.offline import LLM

    llm = LLM(dtype="float32", multiprocess=False)  # quire-demo, a generative model
    try:
        with pytest.raises(ValidationError, match="task embed") as error:
            llm.embed("hello", use_tqdm=False)
        assert error.value.param == "model"
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def qwen3_hidden(tiny_checkpoint, corpus_token_ids):
    """A tiny Qwen3's prompts and ``transformers``' last hidden states for them (the base model, float32)."""
    import torch
    from transformers import AutoModel

    folder = tiny_checkpoint("qwen3")
    model = AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    prompts = [corpus_token_ids[i * 97:i * 97 + n] for i, n in enumerate((5, 40, 150, 33, 150))]
    prompts[4] = prompts[2][:120] + prompts[4][:30]  # shares a 120-token prefix with prompt 2
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in prompts]
    return folder, prompts, hidden


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_qwen3_last_token_pooling_equals_transformers(qwen3_hidden):
    from quire.offline import LLM

    folder, prompts, hidden = qwen3_hidden
    # a small budget: long prompts are computed in chunks; prompt 4 then hits prompt 2's cached prefix
    llm = LLM(folder, task="embed", dtype="float32", max_num_batched_tokens=64, multiprocess=False)
    try:
        outputs = llm.embed(prompts[:4], use_tqdm=False)
        outputs += llm.embed(prompts[4:], use_tqdm=False)
        expected = normalized(np.stack([h[-1] for h in hidden]))
        np.testing.assert_allclose(vectors(outputs), expected, rtol=0, atol=1e-5)
        assert outputs[4].num_cached_tokens >= 64  # last-token pooling of a causal model reuses cached prefixes
    finally:
        llm.shutdown()


def test_qwen3_mean_pooling_accumulates_over_chunks(qwen3_hidden):
    from quire.offline import LLM

    folder, prompts, hidden = qwen3_hidden
    llm = LLM(folder, task="embed", dtype="float32", max_num_batched_tokens=64, multiprocess=False,
              pooler_config={"pooling_type": "mean", "normalize": False})
    try:
        outputs = llm.embed(prompts, use_tqdm=False)
        np.testing.assert_allclose(vectors(outputs), np.stack([h.mean(0) for h in hidden]), rtol=0, atol=1e-5)
        assert outputs[4].num_cached_tokens == 0  # mean pooling needs every token's hidden state
    finally:
        llm.shutdown()
