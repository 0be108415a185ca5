"""Owns the completions and chat endpoints' logic: admission, the engine submission, the replies.

    body -> prompt token ids -> limits -> SamplingParams (one per choice) -> reserve queue room
         -> EngineLoop.submit -> outputs -> JSON reply, or server-sent events when stream=true

`n` choices are n engine requests on the same prompt (seed + i when a seed is given); the prefix
cache shares their full prompt blocks. The cache scope comes from the authenticated tenant only
(Tenant.cache_scope); the body's cache_salt can only narrow it. A client that goes away aborts
its engine requests at once (their blocks are freed). Nothing here logs prompt or output text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from isolab.engine.llm_engine import RequestOutput
from isolab.errors import InvalidRequestError, PromptTooLongError, RequestAborted
from isolab.models.tokenizer import Tokenizer
from isolab.sampling_params import SamplingParams
from isolab.server.engine_loop import EngineLoop, EngineRequest
from isolab.server.metrics import ServerMetrics
from isolab.server.outputs import ChoiceText, CompletionLogprobs, chat_logprobs
from isolab.server.protocol import ChatCompletionRequest, CompletionRequest
from isolab.server.settings import ServerConfig
from isolab.server.tenants import Tenant

log = logging.getLogger("isolab.server")


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(exc: InvalidRequestError) -> ApiError:
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
    return ApiError(400, str(exc), param=exc.field, code=code)


@dataclass
class _Choice:
    index: int
    prompt_index: int
    request_id: str
    text: ChoiceText
    completion_lp: CompletionLogprobs | None
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[Any] = field(default_factory=list)


@dataclass
class _Call:
    """One HTTP request in flight: its choices, its engine requests, its clean-up."""

    kind: str  # "completion" | "chat"
    response_id: str
    created: int
    model: str
    prompt_lengths: list[int]
    choices: list[_Choice]
    by_request: dict[str, _Choice]
    stream: bool
    include_usage: bool
    want_logprobs: bool
    arrival: float
    first_token_at: float | None = None
    done: bool = False

    @property
    def unfinished_ids(self) -> list[str]:
        return [c.request_id for c in self.choices if c.finish_reason is None]

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_lengths)
        completion = sum(c.num_tokens for c in self.choices)
        # cached tokens: the first choice of each prompt (later choices share what it wrote)
        n = len(self.choices) // len(self.prompt_lengths)
        cached = sum(self.choices[i * n].num_cached_tokens for i in range(len(self.prompt_lengths)))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class Serving:
    def __init__(self, engine_loop: EngineLoop, config: ServerConfig, metrics: ServerMetrics,
                 model_name: str, tokenizer: Tokenizer, max_model_len: int, capacity: int) -> None:
        self.loop = engine_loop
        self.config = config
        self.metrics = metrics
        self.model_name = model_name
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.capacity = capacity  # engine requests admitted at once: running slots + queue

    # -- endpoints ------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, tenant: Tenant, request: Request) -> Response:
        self._check_common(body)
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of is not supported beyond best_of == n", param="best_of")
        prompts = self._completion_prompts(body.prompt)
        max_tokens = self._max_tokens(body.max_tokens, self.config.default_completion_max_tokens, None)
        return await self._run("completion", body, prompts, max_tokens, body.logprobs, tenant, request)

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, request: Request) -> Response:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise ApiError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tok.apply_chat_template(messages)
        except InvalidRequestError as exc:
            raise bad_request(exc) from None
        self._check_prompt_length(ids)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._max_tokens(requested, self.config.default_chat_max_tokens, len(ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await self._run("chat", body, [ids], max_tokens, logprobs, tenant, request)

    # -- checks -----------------------------------------------------------------------------------------
    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if body.n > self.config.max_n:
            raise ApiError(400, f"n must be at most {self.config.max_n}", param="n")
        if body.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            raw: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            raw = [list(prompt)]  # type: ignore[arg-type]
        else:
            raw = list(prompt)  # type: ignore[arg-type]
        if not raw:
            raise ApiError(400, "the prompt list is empty", param="prompt")
        if len(raw) > self.config.max_prompts:
            raise ApiError(400, f"at most {self.config.max_prompts} prompts per request", param="prompt")
        out = []
        for p in raw:
            ids = self.tok.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise ApiError(400, "a prompt is empty: send at least one token", param="prompt")
            self._check_prompt_length(ids)
            out.append(ids)
        return out

    def _check_prompt_length(self, ids: list[int]) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit}",
                           param="prompt", code="context_length_exceeded")

    def _max_tokens(self, requested: int | None, default: int, prompt_len: int | None) -> int:
        limit = self.config.max_tokens_limit
        if requested is not None:
            if requested > limit:
                raise ApiError(400, f"max_tokens is {requested}; this server allows at most {limit}", param="max_tokens")
            return requested
        value = min(default, limit)
        if prompt_len is not None:  # room left in the context, so a long chat still gets an answer
            value = max(1, min(value, self.max_model_len - prompt_len))
        return value

    # -- the run ----------------------------------------------------------------------------------------
    async def _run(self, kind: str, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                   max_tokens: int, logprobs: int | None, tenant: Tenant, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            scope = tenant.cache_scope(body.cache_salt)
            params = [
                SamplingParams(
                    max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    seed=None if body.seed is None else (body.seed + i) % 2**63, stop=body.stop_list(),
                    stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, logprobs=logprobs,
                )
                for i in range(body.n)
            ]
        except InvalidRequestError as exc:
            raise bad_request(exc) from None
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        choices, engine_requests = [], []
        for p_i, ids in enumerate(prompts):
            for j in range(body.n):
                index = p_i * body.n + j
                rid = f"{response_id}-{index}"
                choices.append(_Choice(index, p_i, rid, ChoiceText(self.tok, body.stop_list()),
                                       CompletionLogprobs(self.tok) if kind == "completion" and logprobs is not None else None))
                engine_requests.append(EngineRequest(rid, tuple(ids), params[j]))
        call = _Call(kind, response_id, int(time.time()), self.model_name, [len(p) for p in prompts], choices,
                     {c.request_id: c for c in choices}, body.stream,
                     bool(body.stream_options and body.stream_options.include_usage), logprobs is not None, arrival)

        num = len(engine_requests)
        if num > self.capacity:
            raise ApiError(400, f"prompts x n = {num} engine requests; this server runs at most {self.capacity} at once",
                           param="n")
        if not self.loop.try_reserve(num, self.capacity):
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, f"the server's queue is full ({self.capacity} requests in flight); retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        try:
            queue = await self.loop.submit(engine_requests, scope)
        except InvalidRequestError as exc:
            self.loop.release(num)
            raise bad_request(exc) from None
        except RequestAborted:
            self.loop.release(num)
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        except BaseException:
            self.loop.release(num)
            raise
        self.metrics.prompt_tokens.inc(sum(call.prompt_lengths))

        def cleanup() -> None:
            if call.done:
                return
            call.done = True
            unfinished = call.unfinished_ids
            if unfinished:
                self.loop.abort(unfinished)
                self.metrics.requests_finished.labels("abort").inc(len(unfinished))
            self.loop.release(num)
            self.metrics.cached_tokens.inc(call.usage()["prompt_tokens_details"]["cached_tokens"])
            self._log(call, tenant, aborted=len(unfinished))

        if call.stream:
            return _CleanupStream(self._stream(call, queue), cleanup, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collector = asyncio.ensure_future(self._collect(call, queue))
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
        errors = [c.error for c in call.choices if c.error]
        if errors:
            raise ApiError(500, errors[0], type="server_error")
        return JSONResponse(self._final_body(call))

    # -- consuming outputs ----------------------------------------------------------------------------------
    def _consume(self, call: _Call, o: RequestOutput) -> tuple[_Choice, str, list[Any] | dict[str, Any] | None]:
        """Fold one output into its choice; returns (choice, text delta, logprobs delta)."""
        c = call.by_request[o.request_id]
        lp_delta: list[Any] | dict[str, Any] | None = None
        delta = ""
        if o.new_token_ids:
            if call.first_token_at is None:
                call.first_token_at = time.monotonic()
                self.metrics.ttft.observe(call.first_token_at - call.arrival)
            c.num_tokens += len(o.new_token_ids)
            c.num_cached_tokens = o.num_cached_tokens
            self.metrics.generation_tokens.inc(len(o.new_token_ids))
            delta = c.text.push(o.new_token_ids)
            if call.want_logprobs and o.new_logprobs:
                if c.completion_lp is not None:
                    lp_delta = c.completion_lp.format(o.new_logprobs)
                else:
                    lp_delta = chat_logprobs(self.tok, o.new_logprobs)
        if o.finished:
            delta += c.text.finish()
            c.finish_reason = o.finish_reason or "stop"
            if o.error is not None or o.finish_reason == "error":
                c.error = "the engine failed this request" if o.finish_reason == "error" else str(o.error)
            self.metrics.requests_finished.labels(c.finish_reason).inc()
        return c, delta, lp_delta

    async def _collect(self, call: _Call, queue: asyncio.Queue[RequestOutput]) -> None:
        while any(c.finish_reason is None for c in call.choices):
            o = await queue.get()
            c, _, lp = self._consume(call, o)
            if lp is not None:
                if isinstance(lp, dict):
                    if not c.logprobs:
                        c.logprobs = [lp]
                    else:
                        for k in lp:
                            c.logprobs[0][k].extend(lp[k])
                else:
                    c.logprobs.extend(lp)
        self.metrics.e2e.observe(time.monotonic() - call.arrival)

    def _final_body(self, call: _Call) -> dict[str, Any]:
        choices = []
        for c in call.choices:
            text = c.text.sent
            if call.kind == "completion":
                lp: Any = (c.logprobs[0] if c.logprobs else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                               "text_offset": []}) if call.want_logprobs else None
                choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                "logprobs": {"content": c.logprobs} if call.want_logprobs else None,
                                "finish_reason": c.finish_reason})
        obj = "text_completion" if call.kind == "completion" else "chat.completion"
        return {"id": call.response_id, "object": obj, "created": call.created, "model": call.model,
                "choices": choices, "usage": call.usage()}

    async def _stream(self, call: _Call, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[str]:
        obj = "text_completion" if call.kind == "completion" else "chat.completion.chunk"
        head = {"id": call.response_id, "object": obj, "created": call.created, "model": call.model}

        def chunk(choice: dict[str, Any]) -> str:
            return _sse({**head, "choices": [choice]})

        if call.kind == "chat":
            yield "".join(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}) for c in call.choices)
        while any(c.finish_reason is None for c in call.choices):
            outs = [await queue.get()]
            while not queue.empty():
                outs.append(queue.get_nowait())
            parts = []
            for o in outs:
                c, delta, lp = self._consume(call, o)
                if c.error:
                    parts.append(_sse({"error": {"message": c.error, "type": "server_error", "param": None, "code": None}}))
                    continue
                if delta or lp is not None:
                    if call.kind == "completion":
                        parts.append(chunk({"index": c.index, "text": delta, "logprobs": lp, "finish_reason": None}))
                    else:
                        parts.append(chunk({"index": c.index, "delta": {"content": delta},
                                            "logprobs": {"content": lp} if lp is not None else None,
                                            "finish_reason": None}))
                if c.finish_reason is not None:
                    if call.kind == "completion":
                        parts.append(chunk({"index": c.index, "text": "", "logprobs": None,
                                            "finish_reason": c.finish_reason}))
                    else:
                        parts.append(chunk({"index": c.index, "delta": {}, "logprobs": None,
                                            "finish_reason": c.finish_reason}))
            if parts:
                yield "".join(parts)
        self.metrics.e2e.observe(time.monotonic() - call.arrival)
        if call.include_usage:
            yield _sse({**head, "choices": [], "usage": call.usage()})
        yield "data: [DONE]\n\n"

    def _log(self, call: _Call, tenant: Tenant, aborted: int) -> None:
        # counts only: never the prompt, the output, or the key
        log.info("%s tenant=%s choices=%d prompt_tokens=%d output_tokens=%d cached_tokens=%d finish=%s aborted=%d "
                 "seconds=%.3f", call.response_id, tenant.tenant_id, len(call.choices), sum(call.prompt_lengths),
                 sum(c.num_tokens for c in call.choices), call.usage()["prompt_tokens_details"]["cached_tokens"],
                 ",".join(sorted({c.finish_reason or "abort" for c in call.choices})), aborted,
                 time.monotonic() - call.arrival)
