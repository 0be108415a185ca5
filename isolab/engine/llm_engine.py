"""Owns the engine loop: add_request / step / abort over the scheduler and the model runner.

    step():  scheduler.schedule() -> SchedulerOutput
             (audit mode: the auditor checks every chunk's reads and writes; a violation aborts
              that request before anything is computed)
             runner.execute(SchedulerOutput) -> ModelRunnerOutput   (forward + sampling)
             scheduler.update(SchedulerOutput, ModelRunnerOutput) -> finished requests
                 (commit K/V bookkeeping, num_computed_tokens, output tokens, stop checks)
             -> one RequestOutput per sampled token (a max_tokens 0 request: one, with no token, when its
                prompt is computed; the token sampled after it is not kept)

Builds the components from the config and hands each its faults (isolab.faults) once. Single-
threaded by design: one caller drives step(). The server runs it in one thread.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass

import torch

from isolab import kernels
from isolab.config import EngineConfig
from isolab.engine.audit import Auditor
from isolab.engine.block_pool import BlockPool
from isolab.engine.detokenize import Detokenizer
from isolab.engine.events import EventSink, JsonlSink, NullSink
from isolab.engine.grammar import GrammarCompiler
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.kv_groups import kv_groups
from isolab.engine.kv_storage import KVStorage, bytes_per_block
from isolab.engine.model_runner import ModelRunner
from isolab.engine.request import Request, RequestStatus, TokenLogprob
from isolab.engine.sampler import make_generator
from isolab.engine.scheduler import Scheduler
from isolab.engine.step import NOT_FINITE, SchedulerOutput
from isolab.errors import InvalidRequestError, IsolabError, PromptTooLongError
from isolab.models.bundle import ModelBundle, load_bundle
from isolab.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]  # sampled this step
    new_logprobs: tuple[TokenLogprob, ...]
    output_token_ids: tuple[int, ...]  # all sampled so far
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None  # the stop string or stop token that ended it
    num_prompt_tokens: int
    num_cached_tokens: int
    error: IsolabError | None = None
    # params.prompt_logprobs only, on the request's first output: entry i is prompt token i + 1's
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def stopped_by_token(self) -> bool:
        """Whether a stop_token_ids token ended the request: its last token, which the text leaves out
        (as vLLM; the server and LLM.generate cut it)."""
        return (self.finished and self.finish_reason == "stop" and isinstance(self.stop_reason, int)
                and not isinstance(self.stop_reason, bool) and self.output_token_ids[-1:] == (self.stop_reason,))


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, bundle: ModelBundle | None = None) -> None:
        self.config = config = config or EngineConfig()
        faults = config.faults
        # FAULT batch-variant-gemm: a GEMM whose reduction order changes with M, kept whatever the check says.
        gemm = "split-k" if faults.batch_variant_gemm else config.gemm
        if bundle is not None and gemm is not None and bundle.model.numerics.gemm_path != gemm:
            bundle = load_bundle(bundle.path, bundle.dtype, str(bundle.model.device), gemm, bundle.weights)  # type: ignore[arg-type]
        self.bundle = bundle or load_bundle(config.model, config.dtype, config.device, gemm,  # type: ignore[arg-type]
                                            config.weights)
        hp = self.bundle.hparams
        self.tokenizer = self.bundle.tokenizer
        self.model = self.bundle.model
        if config.max_model_len is not None and config.max_model_len > hp.context_length:  # (as vLLM refuses it)
            raise InvalidRequestError(f"max_model_len {config.max_model_len} is longer than the model's context of "
                                      f"{hp.context_length} tokens: give at most {hp.context_length}, or leave it out",
                                      field="max_model_len")
        self.max_model_len = config.max_model_len or hp.context_length
        cc = config.cache
        if self.model.native_kernels and cc.block_size % kernels.FAST_BLOCK_SIZE:
            log.warning("block_size %d: the native attention kernel's fast paths are built for blocks of a multiple "
                        "of %d tokens; this engine's attention takes its generic loop (about 3x slower steps at 128 "
                        "concurrent requests on an AMX Xeon)", cc.block_size, kernels.FAST_BLOCK_SIZE)
        self.kv_groups = kv_groups(hp, cc.window_cache)
        kv_dtype = self.model.dtype
        if cc.kv_cache_dtype == "int8":
            if hp.head_dim % 16:
                raise InvalidRequestError(f"kv_cache_dtype int8 reads heads of a multiple of 16 dimensions; this "
                                          f"model's have {hp.head_dim}", field="kv_cache_dtype")
            kv_dtype = torch.int8
        per_block = bytes_per_block(hp, cc.block_size, kv_dtype, len(self.kv_groups[0].layers))
        num_blocks = cc.kv_cache_memory // per_block
        if num_blocks < 2:
            raise InvalidRequestError(
                f"kv_cache_memory of {cc.kv_cache_memory} bytes holds fewer than 2 blocks of {per_block} bytes",
                field="kv_cache_memory",
            )
        self.events: EventSink = JsonlSink(config.trace_path) if config.trace_path else NullSink()
        self.storage = KVStorage(hp, num_blocks, cc.block_size, kv_dtype, self.model.device, self.kv_groups)
        # the start-up check's verdict for this engine: the model's, with the int8 pool's attention
        # checked too when the pool is 8-bit (/health, the doctor and selftest read this)
        self.numerics = self.bundle.engine_numerics(cc.kv_cache_dtype)
        self.pool = BlockPool(
            num_blocks,
            storage=self.storage,
            audit=config.audit,
            faults=faults,
            events=self.events,
            # the native kernel reads a row's keys up to its position; the torch attention (CUDA, no
            # compiler) reads whole blocks and masks them, and 0 x inf is NaN
            clear_on_allocate=self.numerics.attention != "native",
        )
        self.kv = KVCacheManager(
            self.pool,
            cc.block_size,
            weights_fingerprint=self.bundle.fingerprint,
            dtype=self.bundle.cache_numerics_key(cc.kv_cache_dtype),
            enable_prefix_caching=cc.enable_prefix_caching,
            faults=faults,
            windows=tuple(g.window for g in self.kv_groups),
        )
        # The most tokens (prompt + new) one request can hold: the context, or less where the KV pool
        # is smaller (the largest total the add_request check below admits). The server caps its
        # default max_tokens by it.
        lo, hi = 0, self.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.max_blocks_needed(mid, config.scheduler.max_num_batched_tokens) <= self.pool.num_usable_blocks:
                lo = mid
            else:
                hi = mid - 1
        self.max_request_tokens = lo
        self.scheduler = Scheduler(config.scheduler, self.kv, self.tokenizer.eos_token_id, self.max_model_len,
                                   end_of_turn=self.tokenizer.end_of_turn_ids, is_special=self.tokenizer.is_skipped)
        self.runner = ModelRunner(self.model, self.storage, self.kv, faults, self.tokenizer.eos_token_id, self.kv_groups,
                                  self.tokenizer.end_of_turn_ids)
        self.auditor = Auditor(self.kv, self.storage) if config.audit else None
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None
        self.step_count = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_scope: str | None = None,
    ) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        if cache_scope is not None and not isinstance(cache_scope, str):  # (an int failed only once a block was hashed)
            raise InvalidRequestError(f"cache_scope is a tenant's name (a str) or None, not {type(cache_scope).__name__}",
                                      field="cache_scope")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token", field="prompt")
        vocab = self.bundle.hparams.vocab_size
        # integers of any kind (numpy's too: they were refused as not integers), never bools (True was id 1)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", field="prompt")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        for field, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            outside = [t for t in ids if t >= vocab]
            if outside:  # (as the server's 400: a token the model cannot produce is a mistake, not a no-op)
                raise InvalidRequestError(f"{field} names token {outside[0]}, outside the vocabulary [0, {vocab})",
                                          field=field)
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} token{'s' * (n != 1)} and max_tokens is {params.max_tokens}: together more than the "
                f"context of {self.max_model_len} tokens",
                field="prompt",
            )
        blocks = self.kv.max_blocks_needed(n + params.max_tokens, self.config.scheduler.max_num_batched_tokens)
        if blocks > self.pool.num_usable_blocks:
            raise PromptTooLongError(
                f"the request needs {blocks} KV blocks ({n} prompt tokens + {params.max_tokens} new) but the "
                f"cache holds {self.pool.num_usable_blocks}: it can never fit; raise kv_cache_memory",
                field="prompt",
            )
        req = Request(request_id, list(prompt_token_ids), params, cache_scope)
        if not params.greedy:
            req.generator = make_generator(params.seed, self.model.device)
        if params.stop:
            req.detokenizer = Detokenizer(self.tokenizer)
        if params.structured is not None:
            req.matcher = self.grammars.matcher(self.grammars.compile(params.structured))
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.num_prompt_tokens += n

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler, built on first use (compiled grammars are cached, shared)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.bundle.hparams.vocab_size, self.bundle.fingerprint)
        return self._grammars

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed at once. False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self.events.flush()
        return True

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Abort or audit failure: the scheduler ends the request (blocks freed), then we forget it."""
        self.scheduler.finish(req, status)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        """The one way an ended request leaves the engine and the auditor."""
        self.requests.pop(req.request_id, None)
        if self.auditor:
            self.auditor.forget(req.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_count += 1
        self.events.set_step(self.step_count)
        try:
            return self._step()
        finally:
            self.events.flush()

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if self.auditor is not None:
            out, outputs = self._audit(out)
        if not out.chunks:
            return outputs
        result = self.runner.execute(out)
        finished = self.scheduler.update(out, result)
        for s in result.sampled:
            req = self.requests[s.request_id]
            if not req.output_token_ids or s.token_id == NOT_FINITE:  # the scheduler kept no token (max_tokens
                outputs.append(self._output(req, (), ()))  # 0: the prompt only; a row of NaN logits)
                continue
            outputs.append(self._output(req, (s.token_id,), (s.logprob,) if s.logprob else ()))
            self.num_generated_tokens += 1
        for req in finished:
            self._forget(req)
        return outputs

    def _audit(self, out: SchedulerOutput) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """Check every chunk before the forward; a violating request is aborted with the violation."""
        assert self.auditor is not None
        # every chunk is checked against the state the forward would see, before any abort frees blocks
        verdicts = [(ch.request, self.auditor.check_chunk(ch)) for ch in out.chunks]
        outputs = []
        for req, v in verdicts:
            if v is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(req, (), (), error=v))
        failed = {req.request_id for req, v in verdicts if v is not None}
        return (out.without(failed) if failed else out), outputs

    def _output(
        self,
        req: Request,
        new: tuple[int, ...],
        new_lp: tuple[TokenLogprob, ...],
        error: IsolabError | None = None,
    ) -> RequestOutput:
        finished = req.status.finished
        error = error if error is not None else req.error
        reason = "error" if error is not None else (req.status.value if finished else None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new,
            new_logprobs=new_lp,
            output_token_ids=tuple(req.output_token_ids),
            finished=finished,
            finish_reason=reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            error=error,
            prompt_logprobs=tuple(req.prompt_logprobs)
            if req.params.prompt_logprobs is not None and len(req.output_token_ids) == len(new) else None,
        )

    # -- introspection ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_blocks_total": self.pool.num_usable_blocks,
            "kv_blocks_free": self.pool.num_free_blocks,
            "kv_blocks_used": self.pool.num_usable_blocks - self.pool.num_free_blocks,
            "prefix_cache_queries_tokens": self.kv.num_query_tokens,
            "prefix_cache_hits_tokens": self.kv.num_hit_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "evictions": self.pool.num_evictions,
            "audit_violations": len(self.auditor.violations) if self.auditor else 0,
            "steps": self.step_count,
        }

    def close(self) -> None:
        self.events.close()


def empty_cache_check(engine: LLMEngine) -> None:
    """Assert that an idle engine holds no blocks (used by tests and the server's drain)."""
    assert not engine.has_unfinished()
    assert engine.kv.num_held_blocks() == 0
    engine.pool.check_invariants()


