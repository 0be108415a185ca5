"""Owns the gate in front of every route: metrics count, drain, auth, body limit (ASGI middleware).

    client -> Gate: count the reply's status -> 503 while draining -> 401 without a valid key
                    (on /v1/*, /tokenize, /detokenize) -> 413 past the body limit -> 415 for a
                    compressed body, 400 for one not in UTF-8 -> FastAPI routes

The body is read once here (up to the limit, never past it) and replayed to the app. The tenant
goes into the request's scope state. Does not know the routes' logic or the reply formats.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from isolab.server.errors import ApiError, shutting_down
from isolab.server.state import ServerState

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics")
GATED = ("/v1/", "/tokenize", "/detokenize")  # paths that need a tenant's key


class Gate:
    """Pure ASGI middleware; see the module docstring for the order of its checks."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        # (one label for every model's own path: a label per model name would let clients grow the series)
        route = path if path in ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
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
        if path.startswith(GATED):
            if self.state.draining:
                await shutting_down(headers={"Connection": "close"}).response()(scope, receive, send)
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
            unreadable = _unreadable(scope, body) if path in ROUTES else None  # (elsewhere: the 404 says more)
            if unreadable is not None:
                self.state.metrics.rejected.labels("unreadable_body").inc()
                await unreadable.response()(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _unreadable(scope: Scope, body: bytes) -> ApiError | None:
    """A body the JSON parser cannot read for a reason we can name (the parser itself says only
    'There was an error parsing the body'): compressed, or not UTF-8."""
    for name, value in scope.get("headers", ()):
        if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            encoding = value.decode("latin-1")[:32]
            return ApiError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                            code="unsupported_content_encoding")
    if body.isascii():  # most bodies (JSON escapes what is not ASCII): no copy decoded only to be dropped
        return None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ApiError(400, f"the body is not UTF-8 (byte {exc.start} cannot start or continue a character): "
                             "send JSON in UTF-8")
    return None


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
