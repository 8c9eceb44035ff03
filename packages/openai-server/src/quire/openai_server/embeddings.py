"""The pooling endpoints of an embedding model: ``POST /v1/embeddings`` (OpenAI's), and vLLM's ``/score``
(cosine similarity of text pairs) and ``/rerank`` (documents ordered by their similarity to a query).

Every text becomes one ``engine.encode`` request; a request's texts run concurrently and each distinct
text is embedded once. Their bodies live here rather than in protocol.py, which holds the generation API's.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, Field

from quire.core.errors import ValidationError
from quire.core.outputs import PoolingRequestOutput
from quire.core.pooling_params import PoolingParams, cosine_similarity, score_pairs
from quire.openai_server.protocol import _Request
from quire.openai_server.serving import ServerState, request_id, until_disconnect

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # engine extras (vLLM's names)
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None


class ScoreRequest(_Request):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a string: base64 of the little-endian float32 values


class _ListResponse(BaseModel):
    """What ``/v1/embeddings`` and ``/score`` answers share (their ``data`` differs)."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingData]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


async def create_embedding(state: ServerState, body: EmbeddingRequest, request: Request):
    """``/v1/embeddings``; None when the client went away."""
    _check_pooling_request(state, body.model, "embed")
    inputs = embedding_inputs(body.input)
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                           truncate_prompt_tokens=body.truncate_prompt_tokens)
    base_id = request_id("embd", request, body.request_id)
    fields = ["input"] * len(inputs)
    outputs = await until_disconnect(request, embed_all(state, inputs, fields, params, base_id, body.priority))
    if outputs is None:
        return None
    data = [EmbeddingData(index=index, embedding=_encoded(output.outputs.embedding, body.encoding_format))
            for index, output in enumerate(outputs)]
    return EmbeddingResponse(id=base_id, model=state.model_name, data=data, usage=_usage(outputs))


async def create_score(state: ServerState, body: ScoreRequest, request: Request):
    """``/score``: the relevance of each ``(text_1, text_2)`` pair (a cross-encoder's, or the cosine similarity
    of the embeddings); None when the client went away."""
    _check_pooling_request(state, body.model, "embed", "score")
    pairs = score_pairs(body.text_1, body.text_2)
    params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens)
    base_id = request_id("score", request, body.request_id)
    if state.engine.task == "score":
        scores = await until_disconnect(request, _cross_encode(state, pairs, params, base_id, body.priority, "text_1"))
        if scores is None:
            return None
        data = [ScoreData(index=index, score=score) for index, score in enumerate(scores[0])]
        return ScoreResponse(id=base_id, model=state.model_name, data=data, usage=_usage(scores[1]))
    named = [("text_1", first) for first, _ in pairs] + [("text_2", second) for _, second in pairs]
    embedded = await until_disconnect(request, _embed_distinct(state, named, params, base_id, body.priority))
    if embedded is None:
        return None
    vectors, outputs = embedded
    data = [ScoreData(index=index, score=cosine_similarity(vectors[first], vectors[second]))
            for index, (first, second) in enumerate(pairs)]
    return ScoreResponse(id=base_id, model=state.model_name, data=data, usage=_usage(outputs))


async def create_rerank(state: ServerState, body: RerankRequest, request: Request):
    """``/rerank``: the documents by their similarity to the query, best first (the first ``top_n``); None
    when the client went away."""
    _check_pooling_request(state, body.model, "embed", "score")
    if not body.documents:
        raise ValidationError("documents must not be empty", param="documents")
    if body.top_n is not None and body.top_n < 0:
        raise ValidationError(f"top_n must be at least 0, got {body.top_n}", param="top_n")
    params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens)
    base_id = request_id("rerank", request, body.request_id)
    if state.engine.task == "score":
        pairs = [(body.query, document) for document in body.documents]
        scored = await until_disconnect(request, _cross_encode(state, pairs, params, base_id, body.priority,
                                                                "documents"))
        if scored is None:
            return None
        scores, outputs = scored
    else:
        named = [("query", body.query)] + [("documents", document) for document in body.documents]
        embedded = await until_disconnect(request, _embed_distinct(state, named, params, base_id, body.priority))
        if embedded is None:
            return None
        vectors, outputs = embedded
        scores = [cosine_similarity(vectors[body.query], vectors[document]) for document in body.documents]
    results = [RerankResult(index=index, relevance_score=score,
                            document=RerankDocument(text=document) if body.return_documents else None)
               for index, (document, score) in enumerate(zip(body.documents, scores))]
    results.sort(key=lambda result: -result.relevance_score)  # stable: ties keep the documents' order
    top_n = body.top_n or len(results)
    return RerankResponse(id=base_id, model=state.model_name, usage=RerankUsage(total_tokens=_num_tokens(outputs)),
                          results=results[:top_n])


def embedding_inputs(value: EmbeddingInput) -> list[str | list[int]]:
    """``input`` as one prompt per vector: a text, a list of texts, token ids, or lists of token ids."""
    if isinstance(value, str) or (value and all(isinstance(item, int) for item in value)):
        inputs = [value]
    else:
        inputs = list(value)
    if not inputs or any(len(item) == 0 for item in inputs):
        raise ValidationError("input must not be empty (nor hold an empty text or token list)", param="input")
    return inputs


def encode_base64(embedding: list[float]) -> str:
    """The vector as base64 of its little-endian float32 bytes (what OpenAI's clients decode)."""
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    return encode_base64(embedding) if encoding_format == "base64" else embedding


async def embed_all(state: ServerState, prompts: list, fields: list[str], params: PoolingParams, base_id: str,
                    priority: int) -> list[PoolingRequestOutput]:
    """One ``engine.encode`` request per prompt (ids ``{base_id}-{i}``), concurrently, in the prompts' order.
    An input error of prompt ``i`` is reported against ``fields[i]``; the first error cancels the rest."""
    tasks = [asyncio.ensure_future(_embed_one(state, prompt, field, params, f"{base_id}-{index}", priority))
             for index, (prompt, field) in enumerate(zip(prompts, fields))]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _embed_one(state: ServerState, prompt, field: str, params: PoolingParams, rid: str,
                     priority: int) -> PoolingRequestOutput:
    outputs = state.engine.encode(prompt, params, rid, priority=priority, timeout=state.settings.request_timeout)
    final = None
    try:
        async for output in outputs:
            final = output
    except ValidationError as error:
        if error.param != "prompt":
            raise
        message = error.message.replace("prompt", field, 1) if "prompt" in error.message else \
            f"{field}: {error.message}"
        raise ValidationError(message, param=field, code=error.code) from None
    finally:
        await outputs.aclose()
    return final


async def _embed_distinct(state: ServerState, named: list[tuple[str, str]], params: PoolingParams, base_id: str,
                          priority: int) -> tuple[dict[str, list[float]], list[PoolingRequestOutput]]:
    """Each distinct text of ``(field, text)`` once: its vector by text, and the outputs (for usage)."""
    fields = {}
    for field, text in named:
        fields.setdefault(text, field)
    outputs = await embed_all(state, list(fields), list(fields.values()), params, base_id, priority)
    return {text: output.outputs.embedding for text, output in zip(fields, outputs)}, outputs


async def _cross_encode(state: ServerState, pairs: list[tuple[str, str]], params: PoolingParams, base_id: str,
                        priority: int, field: str) -> tuple[list[float], list[PoolingRequestOutput]]:
    """A cross-encoder's score of each pair (one request per pair; input errors name ``field``): the scores,
    and the outputs (for usage)."""
    prompts = [{"text": first, "text_pair": second} for first, second in pairs]
    outputs = await embed_all(state, prompts, [field] * len(prompts), params, base_id, priority)
    return [output.outputs.embedding[0] for output in outputs], outputs


def _check_pooling_request(state: ServerState, model: str | None, *tasks: str) -> None:
    if state.check_model(model) is not None:
        raise ValidationError("LoRA adapters do not serve embeddings; name the base model", param="model",
                              code="unsupported_value")
    state.check_task(*tasks)


def _num_tokens(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(output.prompt_token_ids) for output in outputs)


def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    num_tokens = _num_tokens(outputs)
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
