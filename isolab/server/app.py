"""Owns the HTTP surface: routes, the gate (metrics, drain, auth, body limit), errors, lifespan.

    client -> _Gate: count the reply's status -> 503 while draining -> 401 without a valid key
                     (on /v1/*) -> 413 past the body limit -> FastAPI routes -> Serving

/health and /metrics need no key and carry no content (no text, no tenant names).
Every error is answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from isolab.engine.llm_engine import LLMEngine
from isolab.server.engine_loop import EngineLoop
from isolab.server.metrics import CONTENT_TYPE, ServerMetrics
from isolab.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from isolab.server.serving import ApiError, Serving
from isolab.server.settings import ServerConfig
from isolab.server.tenants import Tenant, TenantRegistry

log = logging.getLogger("isolab.server")

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": why}
    for code, why in ((400, "invalid request"), (401, "missing or unknown API key"), (404, "unknown model"),
                      (413, "body too large"), (422, "body does not match the schema"), (429, "queue full"))
}


class _Gate:
    """Pure ASGI middleware; see the module docstring for the order of its checks."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state  # the FastAPI app's state: tenants, config, metrics, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._gated(scope, receive, counting_send, path)
        finally:
            self.state.metrics.http_requests.labels(route, str(status["code"])).inc()

    async def _gated(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        if path.startswith("/v1/"):
            if self.state.draining:
                await ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                               headers={"Connection": "close"}).response()(scope, receive, send)
                return
            tenant = self.state.tenants.authenticate(_bearer(scope))
            if tenant is None:
                self.state.metrics.rejected.labels("auth").inc()
                await ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}).response()(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_body(receive, self.state.config.max_body_bytes)
            if body is None:
                self.state.metrics.rejected.labels("body_too_large").inc()
                await ApiError(413, f"the body is larger than {self.state.config.max_body_bytes} bytes",
                               code="body_too_large").response()(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
            return None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would

    return replay


def create_app(engine: LLMEngine, tenants: TenantRegistry, config: ServerConfig | None = None) -> FastAPI:
    """The app; the engine thread starts with the app's lifespan and stops (aborting) with it."""
    config = config or ServerConfig()
    engine_loop = EngineLoop(engine)
    model_name = config.served_model_name or engine.bundle.name
    capacity = engine.config.scheduler.max_num_seqs + config.max_queue

    def queue_length() -> int:
        return int(engine_loop.stats.get("waiting", 0)) + engine_loop.num_pending_commands

    numerics = engine.model.numerics  # measured once at start (models/invariance.py); read-only after
    metrics = ServerMetrics(lambda: engine_loop.stats, queue_length, numerics)
    serving = Serving(engine_loop, config, metrics, model_name, engine.tokenizer, engine.max_model_len, capacity)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine_loop.alive:
            engine_loop.start()
        log.info("serving %s: %d tenant key(s)%s, capacity %d requests", model_name, tenants.num_keys,
                 " (no auth: one anonymous tenant)" if tenants.anonymous else "", capacity)
        yield
        engine_loop.stop()

    app = FastAPI(title="isolab", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server with per-tenant prefix-cache isolation.")
    app.state.tenants = tenants
    app.state.config = config
    app.state.metrics = metrics
    app.state.engine_loop = engine_loop
    app.state.draining = False
    app.state.started = time.time()
    app.add_middleware(_Gate, state=app.state)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "the body is not valid"))
        return ApiError(422, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.error("internal error: %s", type(exc).__name__)  # no message: it might quote the request
        return ApiError(500, "internal server error", type="server_error").response()

    def tenant_of(request: Request) -> Tenant:
        return request.state.tenant  # set by _Gate on every /v1/ path

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, tenant_of(request), request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, tenant_of(request), request)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=int(app.state.started))])

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine_loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "numerics": numerics.numerics, "batch_invariant": numerics.invariant,
                             "cpu": numerics.cpu})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
