"""A cross-encoder (``BertForSequenceClassification``, task score) through the engine: ``LLM.score`` against
``transformers``' sigmoid of the logit, on a tiny checkpoint built here with a fixed seed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError, ValidationError

QUERY = "How do I reset my password?"
DOCUMENTS = ["Open the account settings page and choose reset password.", "Bananas are yellow.",
             "Passwords can be changed from the settings.", "The weather is nice " * 40]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_folder):
    """A 2-layer BERT cross-encoder (one label) with all-MiniLM-L6-v2's tokenizer, and transformers' model."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=1, initializer_range=0.2)
    model = BertForSequenceClassification(config).eval()
    folder = tmp_path_factory.mktemp("cross-encoder")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (Path(minilm_folder) / name).exists():
            shutil.copy(Path(minilm_folder) / name, folder / name)
    return str(folder), model


def expected_scores(cross_encoder, pairs, zero_token_types=False, **tokenizer_options):
    import torch
    from transformers import AutoTokenizer

    folder, model = cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = []
    for a, b in pairs:
        encoded = tokenizer(a, b, return_tensors="pt", **tokenizer_options)
        if zero_token_types:
            encoded["token_type_ids"] = torch.zeros_like(encoded["token_type_ids"])
        with torch.inference_mode():
            scores.append(torch.sigmoid(model(**encoded).logits[0, 0]).item())
    return scores


def test_scores_equal_transformers(cross_encoder):
    from quire.offline import LLM

    llm = LLM(cross_encoder[0], multiprocess=False)
    try:
        assert llm.llm_engine.task == "score"
        scores = [s.outputs.score for s in llm.score(QUERY, DOCUMENTS[:3], use_tqdm=False)]
        pairs = [(QUERY, d) for d in DOCUMENTS[:3]]
        assert scores == pytest.approx(expected_scores(cross_encoder, pairs), abs=1e-5)
        # the second text is token type 1: a model fed type 0 everywhere scores differently
        wrong = expected_scores(cross_encoder, pairs, zero_token_types=True)
        assert max(abs(s - w) for s, w in zip(scores, wrong)) > 1e-3
        long_pair = [(QUERY * 60, DOCUMENTS[3])]
        with pytest.raises(ValidationError, match="maximum context length"):
            llm.score(*long_pair[0], use_tqdm=False)
        cut = llm.score(*long_pair[0], truncate_prompt_tokens=-1, use_tqdm=False)[0]
        assert len(cut.prompt_token_ids) == 512
        assert cut.outputs.score == pytest.approx(
            expected_scores(cross_encoder, long_pair, truncation=True, max_length=512)[0], abs=1e-5)
        with pytest.raises(ValidationError, match="cross-encoder") as error:
            llm.embed("hello", use_tqdm=False)
        assert error.value.param == "model"
        llm.llm_engine.check_idle_invariants()
    finally:
        llm.shutdown()


def test_a_cross_encoder_runs_task_score_only(cross_encoder, minilm_folder):
    for task in ("embed", "generate"):
        with pytest.raises(ConfigError, match="is a cross-encoder"):
            EngineArgs(model=cross_encoder[0], task=task).create_engine_config()
    with pytest.raises(ConfigError, match="task score runs cross-encoders"):
        EngineArgs(model=minilm_folder, task="score").create_engine_config()


def test_the_server_scores_and_reranks_with_the_cross_encoder(cross_encoder):
    from quire.openai_server.settings import ServerSettings
    from tests.in_process_app import counting_app

    expected = expected_scores(cross_encoder, [(QUERY, d) for d in DOCUMENTS[:3]])
    with counting_app(EngineArgs(model=cross_encoder[0]), ServerSettings(served_model_names=["ce"])) as (client, _):
        response = client.post("/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCUMENTS[:3]})
        assert response.status_code == 200, response.text
        assert [d["score"] for d in response.json()["data"]] == pytest.approx(expected, abs=1e-5)
        response = client.post("/v1/rerank", json={"model": "ce", "query": QUERY, "documents": DOCUMENTS[:3],
                                                   "top_n": 2})
        assert response.status_code == 200, response.text
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in response.json()["results"]] == order
        for path, body in (("/v1/embeddings", {"model": "ce", "input": "hello"}),
                           ("/v1/chat/completions", {"model": "ce", "messages": [{"role": "user", "content": "hi"}]})):
            response = client.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text
        response = client.post("/score", json={"model": "ce", "text_1": QUERY * 60, "text_2": DOCUMENTS[3]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "text_1", response.text
