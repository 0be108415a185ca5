"""Owns the OpenAI error shape: ApiError, the one place its body is built, and the app's handlers.

    {"error": {"message", "type", "param", "code"}}     (protocol.ErrorResponse, also in the docs)

isolab.errors map here: InvalidRequestError -> 400 naming its field (PromptTooLongError: code
context_length_exceeded), RequestAborted -> 503 shutting_down, EngineUnavailable -> 503
engine_unavailable (no replica up). Anything unexpected is a 500 whose
message never quotes the request. Does not know the engine, tenants or the completion formats.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from isolab.errors import EngineUnavailable, InvalidRequestError, PromptTooLongError, RequestAborted
from isolab.server.protocol import ErrorInfo, ErrorResponse
from isolab.server.validation import describe

log = logging.getLogger("isolab.server")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body; every error reply and streamed error event is built here."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


class ApiError(Exception):
    """An error answered with an OpenAI-style body and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shutting_down(headers: dict[str, str] | None = None) -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down", headers=headers)


def api_error(exc: InvalidRequestError | RequestAborted | EngineUnavailable) -> ApiError:
    """The reply for an isolab error a request caused (or met: a shutdown, no engine up)."""
    if isinstance(exc, RequestAborted):
        return shutting_down()
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, str(exc), type="server_error", code="engine_unavailable", headers={"Retry-After": "2"})
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
    return ApiError(400, str(exc), param=exc.field, code=code)


def validation_error(errors: list[Any]) -> ApiError:
    """One 400 for a body that does not validate (validation.describe: the first value at fault, its
    path as `param`)."""
    message, param = describe(errors)
    return ApiError(400, message, param=param)


def install_handlers(app: FastAPI) -> None:
    """Every error the app raises, FastAPI's own included, answers in the OpenAI shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        # 400, as OpenAI answers a body that does not validate (not FastAPI's 422)
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no such route (not a missing model: that says so)
            served = sorted({p for r in app.routes if (p := getattr(r, "path", "")) and not p.startswith(("/docs", "/redoc", "/openapi"))})
            message = f"{request.url.path} is not served here; this server serves {', '.join(served)}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            # (FastAPI's words for a parser failure other than a JSON syntax error; the gate has
            # already named a compressed body and one not in UTF-8)
            message = "the body could not be parsed as JSON (nested too deeply, or a number too long)"
        return ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.error("internal error: %s", type(exc).__name__)  # no message: it might quote the request
        return ApiError(500, "internal server error", type="server_error").response()
