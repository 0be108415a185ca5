"""Owns the two ways a reply goes out: one JSON body at the end, or server-sent events as it comes.

    stream=false: collect every output, then Call.reply()    (a client that goes away: 499, aborted)
    stream=true:  opening chunks, then per output its piece and its finish chunk, the usage chunk
                  if asked, "data: [DONE]"

Either way `cleanup` runs exactly once when the reply ends, however it ends (it aborts what is
left and releases the queue room). A failed choice is a 500, or an error event mid-stream.
Does not know admission, tenants, or the shapes of the two formats.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from isolab.engine.llm_engine import RequestOutput
from isolab.server.call import Call, Choice
from isolab.server.errors import ApiError, error_body

Outputs = asyncio.Queue[RequestOutput]


def streamed(call: Call, queue: Outputs, cleanup: Callable[[], None]) -> Response:
    return _CleanupStream(_events(call, queue), cleanup, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def collected(call: Call, queue: Outputs, request: Request, cleanup: Callable[[], None]) -> Response:
    collector = asyncio.ensure_future(_collect(call, queue))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():  # the client went away: stop its requests now
            collector.cancel()
            return Response(status_code=499)
        collector.result()
    finally:
        watcher.cancel()
        cleanup()
    failed = [c for c in call.choices if c.error]
    if failed:
        raise ApiError(failed[0].error_status, failed[0].error or "", type=_error_type(failed[0]),
                       param=failed[0].error_param, code=_error_code(failed[0]))
    return JSONResponse(call.reply())


async def _collect(call: Call, queue: Outputs) -> None:
    while not call.finished:
        call.consume(await queue.get())
    call.observe_done()


async def _events(call: Call, queue: Outputs) -> AsyncIterator[str]:
    opening = [piece for c in call.choices if (piece := c.out.opening()) is not None]
    if opening:
        yield "".join(_sse(call.chunk(piece)) for piece in opening)
    while not call.finished:
        outs = [await queue.get()]
        while not queue.empty():
            outs.append(queue.get_nowait())
        parts = [event for o in outs for event in _events_of(call, o)]
        if parts:
            yield "".join(parts)
    call.observe_done()
    if call.include_usage:
        yield _sse(call.usage_chunk())
    yield "data: [DONE]\n\n"


def _events_of(call: Call, o: RequestOutput) -> list[str]:
    c, piece = call.consume(o)
    if c.error:
        if c.error in call.errors_sent:  # n choices of one request fail alike (one grammar): one event
            return []
        call.errors_sent.add(c.error)
        return [_sse(error_body(c.error, type=_error_type(c), param=c.error_param, code=_error_code(c)))]
    events = [] if piece is None else [_sse(call.chunk(piece))]
    if c.finish_reason is not None:
        events.extend(_sse(call.chunk(last)) for last in c.finish_chunks())
    return events


def _error_type(c: Choice) -> str:
    return "invalid_request_error" if c.error_status == 400 else "server_error"


def _error_code(c: Choice) -> str | None:
    return "shutting_down" if c.error_status == 503 else None  # as errors.api_error codes RequestAborted


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _CleanupStream(StreamingResponse):
    """A StreamingResponse that always runs `cleanup` when it ends, however it ends."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
