"""Owns the HTTP surface: create_app, its routes and its lifespan; wires the server's parts together.

    client -> gate.Gate (metrics, drain, auth, body limit) -> routes here -> serving.Serving
    errors.install_handlers: every error, FastAPI's own included, in OpenAI's shape

/health and /metrics need no key and carry no content (no text, no tenant names).
Does not know the reply formats or admission (serving, formats).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from isolab.engine.llm_engine import LLMEngine
from isolab.errors import InvalidRequestError
from isolab.server.backend import EngineBackend, ModelFacts
from isolab.server.engine_loop import EngineLoop
from isolab.server.errors import ApiError, install_handlers
from isolab.server.gate import Gate
from isolab.server.metrics import CONTENT_TYPE, ServerMetrics
from isolab.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from isolab.server.serving import Serving
from isolab.server.settings import ServerConfig, default_model_names
from isolab.server.state import ServerState, server_state
from isolab.server.tenants import Tenant, TenantRegistry
from isolab.server.tokenize import DetokenizeRequest, Tokenization, TokenizeRequest

log = logging.getLogger("isolab.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": why}
    for code, why in ((400, "invalid request: a bad value, a wrong type, bad JSON, or a field this server refuses"),
                      (401, "missing or unknown API key"), (404, "unknown model"), (413, "body too large"),
                      (429, "queue full"))
}


def create_app(engine: LLMEngine, tenants: TenantRegistry, config: ServerConfig | None = None) -> FastAPI:
    """The app over one in-process engine; its thread starts with the app's lifespan and stops
    (aborting) with it."""
    names = default_model_names(engine.bundle.path, engine.bundle.name)
    facts = ModelFacts(tokenizer=engine.tokenizer, default_names=names, max_model_len=engine.max_request_tokens,
                       max_num_seqs=engine.config.scheduler.max_num_seqs, num_engines=1,
                       grammars=engine.grammars,  # made here, before the engine thread starts (its tokenizer on first use)
                       numerics=engine.numerics, kv_cache_dtype=engine.config.cache.kv_cache_dtype)
    return create_app_over(EngineLoop(engine), facts, tenants, config)


def create_app_over(backend: EngineBackend, facts: ModelFacts, tenants: TenantRegistry,
                    config: ServerConfig | None = None) -> FastAPI:
    """The app over any backend (one engine, or replicas: isolab.scaleout)."""
    state = _build_state(backend, facts, tenants, config or ServerConfig())
    # no /docs or /redoc: pages that load their scripts from a CDN, outside the key; /openapi.json stays
    app = FastAPI(title="isolab", version="0.1.0", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible server with per-tenant prefix-cache isolation.")
    # Starlette types app.state as its untyped bag; ours is the typed ServerState (server_state()).
    app.state = state  # type: ignore[assignment]
    app.add_middleware(Gate, state=state)
    install_handlers(app)
    _add_routes(app, state)
    return app


def waiting_requests(backend: EngineBackend) -> int:
    """isolab_num_requests_waiting: the engine's queue and the submissions its thread has not taken
    (their requests; an abort waits for nothing)."""
    return int(backend.stats.get("waiting", 0)) + backend.num_pending_requests


def _build_state(backend: EngineBackend, facts: ModelFacts, tenants: TenantRegistry,
                 config: ServerConfig) -> ServerState:
    if config.chat_template is not None:  # a template that cannot render refuses to start, in one sentence
        try:
            rendered = facts.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], template=config.chat_template)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"--chat-template: {exc}", field="chat_template") from None
        if not rendered:  # every chat request would be refused as an empty prompt
            raise InvalidRequestError("--chat-template renders a conversation as nothing: it must write the messages",
                                      field="chat_template")
    names = config.served_model_names or facts.default_names
    capacity = facts.num_engines * (facts.max_num_seqs + config.max_queue)

    metrics = ServerMetrics(lambda: backend.stats, lambda: waiting_requests(backend), facts.numerics)
    backend.register_metrics(metrics.registry)
    serving = Serving(backend, config, metrics, names, facts.tokenizer, facts.max_model_len, capacity, facts.grammars)
    return ServerState(config=config, tenants=tenants, engine_loop=backend, metrics=metrics, serving=serving,
                       tokenization=Tokenization(facts.tokenizer, names, facts.max_model_len, config.chat_template),
                       model_name=names[0], model_names=names, capacity=capacity, numerics=facts.numerics,
                       kv_cache_dtype=facts.kv_cache_dtype)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = server_state(app)
    state.engine_loop.start()  # idempotent
    log.info("serving %s: %d tenant key(s)%s, capacity %d requests", state.model_name, state.tenants.num_keys,
             " (no auth: one anonymous tenant)" if state.tenants.anonymous else "", state.capacity)
    yield
    state.engine_loop.stop()


def _tenant(request: Request) -> Tenant:
    return request.state.tenant  # set by the gate on every /v1/ path


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await state.serving.completions(body, _tenant(request), request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await state.serving.chat(body, _tenant(request), request)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=n, created=int(state.started)) for n in state.model_names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def model(model: str) -> ModelCard:
        """One model's object, by its id or an alias (as OpenAI's GET /v1/models/{model})."""
        if model not in state.model_names:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in state.model_names)}", param="model", code="model_not_found")
        return ModelCard(id=model, created=int(state.started))

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(state.tokenization.tokenize(body))

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(state.tokenization.detokenize(body))

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine_loop.alive:
            return JSONResponse({"status": "engine stopped", **state.engine_loop.describe()}, status_code=503)
        numerics = state.numerics
        return JSONResponse({"status": "ok", "numerics": numerics.numerics, "batch_invariant": numerics.invariant,
                             "weights": numerics.weights, "kv_cache_dtype": state.kv_cache_dtype, "cpu": numerics.cpu,
                             **state.engine_loop.describe()})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)
