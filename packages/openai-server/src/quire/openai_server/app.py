"""``build_app(engine, settings)``: the FastAPI application, with every route of the server."""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

from quire.core.engine.protocol import EngineClient
from quire.core.errors import EngineUtilityError, ValidationError
from quire.core.lora.request import LoRARequest
from quire.core.renderer import is_long
from quire.openai_server.chat import chat_prompt, create_chat_completion
from quire.openai_server.completions import create_completion
from quire.openai_server.embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    create_embedding,
    create_rerank,
    create_score,
)
from quire.openai_server.errors import APIError, install_error_handlers
from quire.openai_server.metrics import CONTENT_TYPE, ServerMetrics
from quire.openai_server.middleware import ServerMiddleware
from quire.openai_server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from quire.openai_server.serving import OUTER_SEND, ServerState
from quire.openai_server.settings import ServerSettings
from quire.openai_server.short_path import ShortGenerationPath

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503, 504)}
# with "stream": true the generation routes answer with server-sent events
GENERATION = {**ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}
_DISCONNECTED = 499  # the client went away before the answer; nobody reads this status


class QuireApp(FastAPI):
    """FastAPI that keeps the server's own ``send`` in the scope (``OUTER_SEND``) for streamed events, and answers
    the generation routes on their short path (``ShortGenerationPath``) unless ``use_short_path`` is False."""

    use_short_path = True
    _short_path: ShortGenerationPath | None | bool = False  # False: not built yet (on the first request)

    async def __call__(self, scope, receive, send) -> None:
        scope[OUTER_SEND] = send
        if self.use_short_path:
            short_path = self._short_path
            if short_path is False:
                short_path = self._short_path = ShortGenerationPath.for_app(self)
            if short_path is not None and short_path.handles(scope):
                return await short_path(scope, receive, send)
        await super().__call__(scope, receive, send)


def build_app(engine: EngineClient | None, settings: ServerSettings) -> FastAPI:
    """The server for one engine client (any ``EngineClient``); all state lives on ``app.state.server``.

    ``engine`` may be None while the model loads (the server answers 503, ``/live`` 200); ``attach_engine``
    brings the app up once it is ready."""
    state = ServerState(engine=None, settings=settings, metrics=ServerMetrics(settings.served_model_names[0]))
    if engine is not None:
        attach_engine(state, engine)
    app = QuireApp(title="Quire OpenAI-compatible API", version=settings.version)
    app.state.server = state
    install_error_handlers(app)
    _add_generation_routes(app)
    _add_pooling_routes(app)
    _add_service_routes(app)
    if settings.enable_lora_runtime_updates:
        _add_lora_routes(app)
    if settings.enable_debug_routes:
        _add_debug_routes(app)
    app.add_middleware(ServerMiddleware, state=state)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


def attach_engine(state: ServerState, engine: EngineClient) -> None:
    """Bring the routes up on a ready engine (the ``--lora-modules`` adapters are checked first)."""
    previous, state.engine = state.engine, engine
    try:
        state.load_lora_modules()
    except BaseException:
        state.engine = previous
        raise
    engine.add_stat_logger(state.metrics)


async def get_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop on every request
    return request.app.state.server


def _add_generation_routes(router: FastAPI) -> None:
    # the state straight from the app, not as a dependency: FastAPI's resolution of one costs every request
    @router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION)
    async def completions(body: CompletionRequest, request: Request):
        state: ServerState = request.app.state.server
        state.check_task("generate")
        result = await create_completion(state, body, request)
        return Response(status_code=_DISCONNECTED) if result is None else result

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state: ServerState = request.app.state.server
        state.check_task("generate")
        result = await create_chat_completion(state, body, request)
        return Response(status_code=_DISCONNECTED) if result is None else result


def _add_pooling_routes(router: FastAPI) -> None:
    """An embedding model's routes (``--task embed``); a generative model answers them with a 400."""

    @router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request, state: ServerState = Depends(get_state)):
        result = await create_embedding(state, body, request)
        return Response(status_code=_DISCONNECTED) if result is None else result

    @router.post("/score", response_model=ScoreResponse, responses=ERRORS)
    @router.post("/v1/score", response_model=ScoreResponse, responses=ERRORS)
    async def score(body: ScoreRequest, request: Request, state: ServerState = Depends(get_state)):
        result = await create_score(state, body, request)
        return Response(status_code=_DISCONNECTED) if result is None else result

    @router.post("/rerank", response_model=RerankResponse, responses=ERRORS)
    @router.post("/v1/rerank", response_model=RerankResponse, responses=ERRORS)
    @router.post("/v2/rerank", response_model=RerankResponse, responses=ERRORS)
    async def rerank(body: RerankRequest, request: Request, state: ServerState = Depends(get_state)):
        result = await create_rerank(state, body, request)
        return Response(status_code=_DISCONNECTED) if result is None else result


def _add_service_routes(router: FastAPI) -> None:
    @router.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models(state: ServerState = Depends(get_state)):
        return ModelList(data=[_card(state, name) for name in state.served_model_names]
                         + [_adapter_card(state, adapter) for adapter in state.lora])

    @router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
    async def retrieve_model(model: str, state: ServerState = Depends(get_state)):
        adapter = state.check_model(model or "-")
        return _card(state, model) if adapter is None else _adapter_card(state, adapter)

    @router.get("/health")
    async def health(state: ServerState = Depends(get_state)):
        """Readiness: 200 while the engine serves, 503 when it is dead or the server is draining."""
        if state.engine.errored:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @router.get("/ping")
    async def ping(state: ServerState = Depends(get_state)):
        return await health(state)

    @router.get("/live")
    async def live(state: ServerState = Depends(get_state)):
        """Liveness: 200 unless the engine is dead (draining is still alive)."""
        if state.engine.errored:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        return {"status": "ok"}

    @router.get("/version")
    async def version(state: ServerState = Depends(get_state)):
        return {"version": state.settings.version}

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics(state: ServerState = Depends(get_state)):
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest, state: ServerState = Depends(get_state)):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValidationError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            prompt = chat_prompt(state, body)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            prompt = {"prompt": body.prompt, "add_special_tokens": add_special}
        renderer = state.engine.renderer
        rendered = await asyncio.to_thread(renderer.render, prompt) if is_long(prompt) else renderer.render(prompt)
        tokens = rendered.token_ids
        strings = state.engine.get_tokenizer().convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens,
                                token_strs=strings)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(get_state)):
        state.check_model(body.model)
        return DetokenizeResponse(prompt=state.engine.renderer.detokenize(body.tokens))

    @router.get("/tokenizer_info")
    async def tokenizer_info(state: ServerState = Depends(get_state)):
        tokenizer = state.engine.get_tokenizer()
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "eos_token_id": tokenizer.eos_token_id, "vocab_size": len(tokenizer),
                "model_max_length": state.engine.max_model_len,
                "chat_template": state.settings.chat_template or getattr(tokenizer, "chat_template", None)}


def _add_debug_routes(router: FastAPI) -> None:
    @router.get("/debug/state")
    async def debug_state(state: ServerState = Depends(get_state)):
        """What the engine and the front end are holding right now (API-key protected)."""
        debug = await state.engine.get_debug_state()
        debug["front_end"]["http_requests_in_flight"] = state.num_in_flight
        return debug

    @router.get("/debug/step_timings")
    async def step_timings(reset: bool = False, state: ServerState = Depends(get_state)):
        """Seconds the engine spent in each phase of its steps (schedule, prepare_inputs, forward,
        sampling, update) and the number of steps, since start-up or the last ``?reset=true``."""
        return await state.engine.get_step_timings(reset)

    @router.post("/debug/check_idle")
    async def check_idle(state: ServerState = Depends(get_state)):
        """200 if nothing is left behind (blocks, requests, runner rows, front-end state); 409 if it is."""
        try:
            await state.engine.check_idle_invariants()
        except EngineUtilityError as error:
            raise APIError(409, str(error), code="not_idle") from None
        return {"idle": True}


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, root=state.engine.model_config.path,
                     max_model_len=state.engine.max_model_len)


def _adapter_card(state: ServerState, adapter: LoRARequest) -> ModelCard:
    return ModelCard(id=adapter.lora_name, created=state.created, root=adapter.lora_path,
                     parent=state.model_name, max_model_len=state.engine.max_model_len)


def _add_lora_routes(router: FastAPI) -> None:
    """``--enable-lora-runtime-updates``: adapters loaded and unloaded by name (vLLM's routes and bodies)."""

    @router.post("/v1/load_lora_adapter", responses=ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: ServerState = Depends(get_state)):
        state.lora.load(body.lora_name, body.lora_path, state.engine.model_config, state.settings.max_lora_rank,
                        state.served_model_names)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", responses=ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: ServerState = Depends(get_state)):
        state.lora.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
