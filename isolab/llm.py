"""Owns the offline Python API: `LLM(...).generate(prompts, SamplingParams(...))` and `.chat(...)`.

Runs every request through the paged engine (continuous batching, prefix caching); returns one
CompletionOutput per prompt, in order. One LLM is one engine: calls from several threads run one after
the other (a lock); to run requests together, pass them in one call, or serve them (`isolab serve`).
"""

from __future__ import annotations

import itertools
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from isolab.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MAX_NUM_SEQS, build_engine_config
from isolab.engine.detokenize import Detokenizer
from isolab.engine.llm_engine import LLMEngine, RequestOutput
from isolab.engine.request import TokenLogprob
from isolab.errors import InvalidRequestError
from isolab.models.bundle import ModelBundle
from isolab.models.tokenizer import Message
from isolab.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: tuple[TokenLogprob, ...] | None = None
    # SamplingParams.prompt_logprobs only: one per prompt token, None for the first (nothing before it)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended it (None: EOS, length)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "bf16",
        *,
        device: str | None = None,
        gemm: str | None = None,
        weights: str = "auto",
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        window_cache: bool = True,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = 512,
        max_prefill_tokens: int | None = None,
        max_model_len: int | None = None,
        audit: bool = False,
        inject_faults: str | Sequence[str] = (),
        trace_path: str | None = None,
        bundle: ModelBundle | None = None,
    ) -> None:
        self.config = build_engine_config(
            model=model, dtype=dtype, device=device, gemm=gemm, weights=weights, kv_cache_memory=kv_cache_memory,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching, window_cache=window_cache,
            kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_prefill_tokens=max_prefill_tokens,
            max_model_len=max_model_len, audit=audit,
            inject_faults=inject_faults, trace_path=trace_path,  # (one name or several: config.fault_names)
        )
        self.engine = LLMEngine(self.config, bundle)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # one call drives the engine at a time: two threads stepping it at once took each other's
        # outputs (a KeyError, a zip() of unequal lengths: every call failed, in a QA pass)
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside a call (an on_step that calls back would wait on itself)
        self._closed = False

    def _enter(self, what: str) -> None:
        if self._owner == threading.get_ident():
            raise InvalidRequestError(f"{what} was called from inside a call of this LLM (an on_step callback): "
                                      "the engine is mid-step; call it after generate returns", field="on_step")
        self._lock.acquire()
        self._owner = threading.get_ident()

    def _leave(self) -> None:
        self._owner = None
        self._lock.release()

    def close(self) -> None:
        """Closes the engine's trace; later calls are refused (a call running in another thread finishes
        first). Also `with LLM(...) as llm:`."""
        self._enter("close")
        try:
            if not self._closed:
                self._closed = True
                self.engine.close()
        finally:
            self._leave()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: send some text", field="prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence):
            return list(cast("Sequence[int]", prompt))  # (not a str: above) the engine checks the ids
        raise InvalidRequestError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}",
                                  field="prompt")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_scope: str | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[CompletionOutput]:
        if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray):  # (bytes: text, not ids)
            raise InvalidRequestError("prompts are text, token ids, or a list of either, not "
                                      f"{type(prompts).__name__}", field="prompt")
        if isinstance(prompts, str) or (prompts and all(isinstance(t, numbers.Integral) for t in prompts)):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if not prompt_list:
            return []
        return self._run(_each(prompt_list, self._prompt_ids, "prompt"), params, cache_scope, on_step, "prompt")

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_scope: str | None = None,
    ) -> list[CompletionOutput]:
        if isinstance(conversations, str) or not isinstance(conversations, Sequence):
            raise InvalidRequestError("chat takes a conversation (a list of {'role', 'content'} messages) or a list "
                                      f"of them, not {type(conversations).__name__}", field="messages")
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        ids = _each(convs, lambda c: self.tokenizer.apply_chat_template(_for_template(c)), "conversation")  # type: ignore[arg-type]
        return self._run(ids, params, cache_scope, None, "conversation")

    def _run(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        cache_scope: str | None,
        on_step: Callable[[list[RequestOutput]], None] | None,
        what: str = "prompt",
    ) -> list[CompletionOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            plist = [params] * len(prompt_ids)
        elif isinstance(params, Sequence) and all(isinstance(p, SamplingParams) for p in params):
            plist = list(params)
        else:
            raise InvalidRequestError(f"params are a SamplingParams, or one per prompt, not {type(params).__name__}",
                                      field="params")
        if len(plist) != len(prompt_ids):
            raise InvalidRequestError("give one SamplingParams, or one per prompt", field="params")
        self._enter("generate" if what == "prompt" else "chat")
        try:
            if self._closed:
                raise InvalidRequestError("this LLM is closed: make a new one", field="llm")
            return self._run_locked(prompt_ids, plist, cache_scope, on_step, what)
        finally:
            self._leave()

    def _run_locked(self, prompt_ids: list[list[int]], plist: list[SamplingParams], cache_scope: str | None,
                    on_step: Callable[[list[RequestOutput]], None] | None, what: str) -> list[CompletionOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompt_ids]
        added: list[str] = []
        try:
            def add(item: tuple[str, list[int], SamplingParams]) -> None:
                self.engine.add_request(item[0], item[1], item[2], cache_scope)
                added.append(item[0])

            _each(list(zip(ids, prompt_ids, plist, strict=True)), add, what)
            final: dict[str, RequestOutput] = {}
            lps: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
            plps: dict[str, tuple[TokenLogprob, ...]] = {}
            while len(final) < len(ids):
                step = self.engine.step()
                if on_step:
                    on_step(step)
                for o in step:
                    lps[o.request_id].extend(o.new_logprobs)
                    if o.prompt_logprobs is not None:
                        plps[o.request_id] = o.prompt_logprobs
                    if o.finished:
                        if o.error is not None:
                            raise o.error
                        final[o.request_id] = o
        finally:
            for rid in added:
                self.engine.abort(rid)  # no-op for finished requests; frees blocks on error
        out = []
        for rid, p, sp in zip(ids, prompt_ids, plist, strict=True):
            o = final[rid]
            out.append(CompletionOutput(
                request_id=rid,
                prompt_token_ids=tuple(p),
                token_ids=o.output_token_ids,
                text=self._text(o, sp),
                finish_reason=o.finish_reason,
                num_cached_tokens=o.num_cached_tokens,
                logprobs=tuple(lps[rid]) if sp.logprobs is not None else None,
                prompt_logprobs=(None, *plps.get(rid, ())) if sp.prompt_logprobs is not None else None,
                stop_reason=o.stop_reason,
            ))
        return out

    def _text(self, o: RequestOutput, sp: SamplingParams) -> str:
        """The output's text as the server returns it: a stop string (counted from min_tokens on, as the
        engine stops) and what follows it cut, and a stop_token_ids token that ended it (as vLLM);
        token_ids and logprobs keep every generated token."""
        ids = o.output_token_ids[:-1] if o.stopped_by_token else o.output_token_ids
        if not sp.stop:
            return self.tokenizer.decode(ids)
        detok = Detokenizer(self.tokenizer, sp.stop, sp.min_tokens)
        for i in ids:  # one at a time, as the engine saw them (a stop string in the first min_tokens - 1 does not count)
            detok.push((i,))
        detok.finish()
        return detok.sent


T = TypeVar("T")
R = TypeVar("R")


def _each(items: Sequence[T], fn: Callable[[T], R], what: str) -> list[R]:
    """fn over items; where there is more than one, an InvalidRequestError says which (from 0): "prompt
    2: the prompt is empty" (a batch's error named none)."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(fn(item))
        except InvalidRequestError as exc:
            if len(items) == 1:
                raise
            raise type(exc)(f"{what} {i}: {exc}", field=exc.field) from None
    return out


def _for_template(conversation: Sequence[Message]) -> list[Message]:
    """The messages as the server reads them (its ChatMessage): roles checked, 'developer' as
    'system', content given as a list of text parts joined, earlier tool calls written out; so a
    conversation gets the same prompt here and over HTTP. A bad message is one sentence."""
    from pydantic import ValidationError

    from isolab.server.protocol import ChatMessage
    from isolab.server.validation import describe

    out = []
    for i, m in enumerate(conversation):
        try:
            out.append(ChatMessage.model_validate(m).for_template())
        except ValidationError as exc:  # the sentence the server's 400 would carry, under messages[i]
            msg, param = describe(list(exc.errors()))
            where = f"messages[{i}].{msg}" if param and msg.startswith(param) else f"messages[{i}]: {msg}"
            raise InvalidRequestError(where, field="messages") from None
    return out
