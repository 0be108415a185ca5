"""Owns scheduling: which requests compute how many tokens each step, admission, preemption,
and applying a step's results (commit, num_computed_tokens, stop checks, finishing).

Does not own blocks (kv_cache_manager.py) nor tensors (model_runner.py). The contract, in
LLMEngine.step:

    schedule() -> SchedulerOutput -> ModelRunner.execute -> ModelRunnerOutput -> update() -> finished

The scheduler is the only writer of a request's num_computed_tokens, status and output.

There is no prefill or decode phase. Each running request computes min(missing, budget) tokens,
where missing = num_tokens - num_computed_tokens; prompt chunks and decode tokens share one
token budget per step. With max_prefill_tokens set, chunks of two or more tokens (prompts, and
recomputations after a preemption) also share that smaller allowance: a running request whose
chunk gets none this step waits, and the decodes after it still run. Ordering rules, applied in
schedule():
  1. running requests first, in admission order (older first);
  2. when blocks run out, the newest running request is preempted (its blocks freed, its
     num_computed_tokens reset to 0; it recomputes prompt + output later and, having its own
     RNG, produces exactly what it would have);
  3. waiting requests are admitted in FIFO order, only if nothing was preempted this step; a
     prefix-cache hit (CachedPrefix) goes from the lookup to the allocation untouched, and
     num_computed_tokens is set only once the allocation succeeded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from isolab.config import SchedulerConfig
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.request import Request, RequestStatus
from isolab.engine.step import NOT_FINITE, ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from isolab.engine.stop import check_stop
from isolab.errors import InvalidRequestError, ModelOutputError


@dataclass
class Scheduler:
    config: SchedulerConfig
    kv: KVCacheManager
    eos_token_id: int | None
    max_model_len: int
    end_of_turn: frozenset[int] = frozenset()  # tokens that stop a request like EOS (Tokenizer.end_of_turn_ids)
    is_special: Callable[[int], bool] = lambda token: False  # a token the text leaves out (Tokenizer.is_skipped)
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    num_preemptions: int = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_prefill_tokens
        prefill = budget if cap is None else min(cap, budget)  # prompt tokens left this step (chunks of 2+)
        chunks: list[ScheduledChunk] = []
        preempted = False

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            missing = req.num_tokens - req.num_computed_tokens
            assert missing > 0, f"request {req.request_id} is running with nothing to compute"
            n = min(missing, budget) if missing == 1 else min(missing, budget, prefill)
            if n == 0:  # a prompt chunk, and the step's prompt tokens are spent: decodes after it still run
                i += 1
                continue
            while not self.kv.allocate_slots(req, req.num_computed_tokens, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                prefill -= n if missing > 1 else 0
                i += 1
                continue
            break  # req itself was preempted: nothing after it can run either

        # 3. waiting requests, FIFO, only when nothing was preempted
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            prefix = self.kv.get_computed_blocks(req)
            missing = req.num_tokens - prefix.num_tokens
            n = min(missing, budget) if missing == 1 else min(missing, budget, prefill)
            if n == 0:
                break
            if not self.kv.allocate_slots(req, prefix.num_tokens, n, prefix):
                break
            self.kv.count_admission(req, prefix)
            self.waiting.popleft()
            req.num_computed_tokens = prefix.num_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = prefix.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, prefix.num_tokens, n))
            budget -= n
            prefill -= n if missing > 1 else 0

        return SchedulerOutput(tuple(chunks))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- update -----------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply an executed step: commit every chunk's K/V, append the sampled tokens, check stops.

        Returns the requests that finished in this step (their blocks are already freed).
        """
        for ch in out.chunks:
            self.kv.commit(ch.request, ch.start, ch.num_new_tokens)
            ch.request.num_computed_tokens = ch.end
        by_id = {ch.request.request_id: ch.request for ch in out.chunks} if result.prompt_logprobs else {}
        for rid, first, lps in result.prompt_logprobs:
            req = by_id[rid]
            have = len(req.prompt_logprobs)  # entry i is prompt token i + 1's; a recompute after
            assert first - 1 <= have, "prompt chunks compute in order"
            if first - 1 + len(lps) > have:  # preemption brings ones already kept: keep the first
                req.prompt_logprobs.extend(lps[have - (first - 1):])
        sampling = [ch.request for ch in out.chunks if ch.samples]
        finished: list[Request] = []
        for req, s in zip(sampling, result.sampled, strict=True):
            assert req.request_id == s.request_id
            if req.params.max_tokens == 0:  # the prompt only (its logprobs): the sampled token is not kept
                self.finish(req, RequestStatus.FINISHED_LENGTH)
                finished.append(req)
                continue
            if s.token_id == NOT_FINITE:  # this row's logits were NaN: the model, not the request, failed
                req.error = ModelOutputError("the model's logits for this request are not numbers (NaN): its "
                                             "weights are broken (a tensor in the model file holds NaN or infinity)")
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                finished.append(req)
                continue
            req.append_output(s.token_id, s.logprob)
            if self._check_stop(req, s.token_id):
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token: int) -> bool:
        grammar_done = False
        if req.matcher is not None:  # this request's own grammar state moves with its own token
            if not req.matcher.is_error():
                req.matcher.consume_token(token)
            if req.matcher.is_error():  # no token continues it (the sampler ended the row): no valid reply
                if self.is_special(token):
                    # llguidance offers forced text that spells a special token only as that token, and
                    # then refuses it (it wants the text's bytes): a grammar that forces "<|im_end|>"
                    why = (f"the output grammar forces text that spells a special token (id {token}); the "
                           "grammar library offers it only as that token and then refuses it, so constants, "
                           "choices and patterns cannot hold special-token text such as <|im_end|>")
                else:
                    why = (f"the output grammar reached a state that no token continues "
                           f"({str(req.matcher.get_error()).partition(chr(10))[0][:200] or 'no reason given'}): "
                           "is the schema satisfiable?")
                req.error = InvalidRequestError(why, field=getattr(req.params.structured, "field", None))
                req.stop_reason = "grammar_error"
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                return True
            grammar_done = bool(req.matcher.is_stopped())
        text, new_len = "", 0
        if req.detokenizer is not None:  # only requests with stop strings decode here
            det = req.detokenizer
            new = det.decode((token,))
            # what a full decode shows now, less the U+FFFD of a character still being completed (no
            # one is sent it: its next bytes replace it); only the last new + pending are unchecked
            pending = det.checkable()
            text, new_len = det.text + pending, len(new) + len(pending)
        decision = check_stop(
            req.params, token, num_output_tokens=len(req.output_token_ids), num_tokens=req.num_tokens,
            eos_token_id=self.eos_token_id, max_model_len=self.max_model_len, end_of_turn=self.end_of_turn, text=text, new_text_len=new_len,
            grammar_done=grammar_done,
        )
        if decision is None:
            return False
        req.stop_reason = decision.reason
        self.finish(req, decision.status)
        return True

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
