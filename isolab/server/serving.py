"""Owns the completions and chat endpoints' logic: admission, the engine submission, the clean-up.

    body -> checks -> Format.plan (prompt token ids, limits) -> SamplingParams (one per choice)
         -> reserve queue room -> EngineLoop.submit -> replies: JSON, or server-sent events

`n` choices are n engine requests on the same prompt (seed + i when a seed is given); the prefix
cache shares their full prompt blocks. The cache scope comes from the authenticated tenant only
(Tenant.cache_scope); the body's cache_salt can only narrow it. A client that goes away aborts
its engine requests at once (their blocks are freed). Nothing here logs prompt or output text.
Does not know the shapes of the replies (formats, call) or HTTP routing (app).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import TypeVar
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response

from isolab.engine.detokenize import Detokenizer
from isolab.engine.grammar import GrammarCompiler
from isolab.engine.llm_engine import RequestOutput
from isolab.errors import EngineUnavailable, InvalidRequestError, RequestAborted
from isolab.models.tokenizer import Tokenizer
from isolab.sampling_params import GrammarSpec, SamplingParams
from isolab.server.backend import EngineBackend
from isolab.server.call import Call, Choice
from isolab.server.engine_loop import EngineRequest
from isolab.server.errors import ApiError, api_error
from isolab.server.formats import ChatFormat, CompletionFormat, Format, Limits, Plan
from isolab.server.metrics import ServerMetrics
from isolab.server.protocol import BaseRequest, ChatCompletionRequest, CompletionRequest
from isolab.server.replies import collected, streamed
from isolab.server.settings import ServerConfig
from isolab.server.structured import structured_spec
from isolab.server.tenants import Tenant

log = logging.getLogger("isolab.server")

BodyT = TypeVar("BodyT", bound=BaseRequest)


class Serving:
    def __init__(self, engine_loop: EngineBackend, config: ServerConfig, metrics: ServerMetrics,
                 model_names: tuple[str, ...], tokenizer: Tokenizer, max_model_len: int, capacity: int,
                 grammars: GrammarCompiler) -> None:
        self.loop = engine_loop
        self.config = config
        self.metrics = metrics
        self.model_names = model_names  # the id, then aliases: a request may name any
        self.model_name = model_names[0]  # what replies carry
        self.tok = tokenizer
        self.capacity = capacity  # engine requests admitted at once: running slots + queue
        self.grammars = grammars  # compiled grammars are shared read-only; matchers are per request
        limits = Limits(config, max_model_len)
        self.completion_format = CompletionFormat(tokenizer, limits)
        self.chat_format = ChatFormat(tokenizer, limits)

    # -- endpoints ------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, tenant: Tenant, request: Request) -> Response:
        return await self._serve(self.completion_format, body, tenant, request)

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, request: Request) -> Response:
        return await self._serve(self.chat_format, body, tenant, request)

    async def _serve(self, fmt: Format[BodyT], body: BodyT, tenant: Tenant, request: Request) -> Response:
        self._check_common(body)
        plan = fmt.plan(body)
        try:
            scope = tenant.cache_scope(body.cache_salt)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        call, engine_requests = self._new_call(fmt, body, plan)
        queue = await self._admit(call, engine_requests, scope)

        def cleanup() -> None:
            self._cleanup(call, tenant, len(engine_requests))

        response = streamed(call, queue, cleanup) if call.stream else await collected(call, queue, request, cleanup)
        if body.ignored_params:  # names only (a value could quote the prompt), header-safe
            names = ",".join(quote(n[:64], safe="_-.[]") for n in body.ignored_params[:32])
            log.info("ignored fields (nobody defines them, or the request makes them moot): %s", names)
            response.headers["x-isolab-ignored-params"] = names
        return response

    # -- checks -----------------------------------------------------------------------------------------
    def _check_common(self, body: BaseRequest) -> None:
        if body.model is not None and body.model not in self.model_names:
            names = ", ".join(repr(n) for n in self.model_names)
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {names}",
                           param="model", code="model_not_found")
        if body.n > self.config.max_n:
            raise ApiError(400, f"n must be at most {self.config.max_n}", param="n")

    # -- the run ----------------------------------------------------------------------------------------
    def _new_call(self, fmt: Format[BodyT], body: BodyT, plan: Plan) -> tuple[Call, list[EngineRequest]]:
        """The call's choices and their engine requests: prompt i, choice j is choice i * n + j."""
        arrival = time.monotonic()
        structured = structured_spec(body)
        if plan.tools is not None and plan.tools.structured is not None:
            if structured is not None:
                raise ApiError(400, f"tool_choice {plan.tools.mode} constrains the output already; drop "
                               f"{structured.field}", param=structured.field)
            structured = plan.tools.structured
        # a JSON output ends itself: a stop string or token would only cut it (GrammarSpec.ends_itself)
        moot = tuple(n for n in ("stop", "stop_token_ids") if getattr(body, n)) if structured and structured.ends_itself else ()
        body.set_moot(moot)
        stops, stop_ids = ((), ()) if moot else (body.stop_list(), self._stop_token_ids(body.stop_token_ids))
        for spec in (structured, plan.tools.check if plan.tools is not None else None):
            if spec is not None:
                try:  # compile here (cached, shared): a bad schema is a 400 before anything is queued
                    self.grammars.compile(spec)
                except InvalidRequestError as exc:
                    raise api_error(exc) from None
        params = [self._sampling_params(body, plan, structured, stops, stop_ids, seed_offset=j) for j in range(body.n)]
        response_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        choices, engine_requests = [], []
        for p_i, ids in enumerate(plan.prompts):
            for j in range(body.n):
                index = p_i * body.n + j
                rid = f"{response_id}-{index}"
                choices.append(Choice(index, rid, Detokenizer(self.tok, stops, body.min_tokens),
                                      fmt.choice(index, plan.logprobs is not None, ids, plan.echo, plan.tools)))
                engine_requests.append(EngineRequest(rid, ids, params[j]))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        call = Call(fmt, response_id, int(time.time()), self.model_name, [len(p) for p in plan.prompts], choices,
                    body.stream, include_usage, arrival, self.metrics)
        return call, engine_requests

    def _sampling_params(self, body: BaseRequest, plan: Plan, structured: GrammarSpec | None, stops: tuple[str, ...],
                         stop_ids: tuple[int, ...], seed_offset: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=plan.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                seed=None if body.seed is None else (body.seed + seed_offset) % 2**64, stop=stops,
                stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, logprobs=plan.logprobs,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, logit_bias=self._logit_bias(body.logit_bias),
                min_p=body.min_p, min_tokens=body.min_tokens, structured=structured,
                prompt_logprobs=plan.logprobs if plan.echo else None,  # echo with logprobs scores the prompt
            )
        except InvalidRequestError as exc:
            sent_max = body.max_tokens if body.max_tokens is not None else getattr(body, "max_completion_tokens", None)
            if exc.field == "min_tokens" and sent_max is None:  # a limit the client did not send: say whose
                exc = InvalidRequestError(f"min_tokens ({body.min_tokens}) must not exceed max_tokens, which this "
                                          f"request leaves to the server's default of {plan.max_tokens}: send max_tokens",
                                          field="min_tokens")
            raise api_error(exc) from None

    def _stop_token_ids(self, ids: list[int] | None) -> tuple[int, ...]:
        """Token ids of this vocabulary, or a 400 (as logit_bias's keys)."""
        for i in ids or ():
            if i >= self.tok.vocab_size:
                raise ApiError(400, f"stop_token_ids must be token ids in [0, {self.tok.vocab_size}), not {i}",
                               param="stop_token_ids")
        return tuple(ids or ())

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} -> ((id, bias), ...); a key that is no token id is a 400."""
        out = []
        for key, value in (bias or {}).items():
            if not re.fullmatch(r"\s*[0-9]{1,10}\s*", key) or int(key) >= self.tok.vocab_size:  # ASCII digits only
                raise ApiError(400, f"logit_bias keys must be token ids in [0, {self.tok.vocab_size}), not {key!r}",
                               param="logit_bias")
            out.append((int(key), float(value)))
        return tuple(out)

    async def _admit(self, call: Call, engine_requests: list[EngineRequest],
                     scope: str) -> asyncio.Queue[RequestOutput]:
        """Reserve queue room for every engine request (or refuse the call), then submit them."""
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
        except (InvalidRequestError, RequestAborted, EngineUnavailable) as exc:
            self.loop.release(num)
            raise api_error(exc) from None
        except BaseException:
            self.loop.release(num)
            raise
        self.metrics.prompt_tokens.inc(sum(call.prompt_lengths))
        return queue

    def _cleanup(self, call: Call, tenant: Tenant, num: int) -> None:
        """Once per call, when its reply ends: abort what is unfinished, release its queue room."""
        if call.done:
            return
        call.done = True
        unfinished = call.unfinished_ids
        if unfinished:
            self.loop.abort(unfinished)
            self.metrics.requests_finished.labels("abort").inc(len(unfinished))
        self.loop.release(num)
        self.metrics.cached_tokens.inc(call.cached_tokens)
        # counts only: never the prompt, the output, or the key
        log.info("%s tenant=%s choices=%d prompt_tokens=%d output_tokens=%d cached_tokens=%d finish=%s aborted=%d "
                 "seconds=%.3f", call.response_id, tenant.tenant_id, len(call.choices), sum(call.prompt_lengths),
                 sum(c.num_tokens for c in call.choices), call.cached_tokens,
                 ",".join(sorted({c.finish_reason or "abort" for c in call.choices})), len(unfinished),
                 time.monotonic() - call.arrival)
