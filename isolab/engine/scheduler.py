"""Owns scheduling: which requests compute how many tokens this step, admission, and preemption.

Does not own blocks (kv_cache_manager.py) nor tensors (model_runner.py). The contract:

    schedule() -> SchedulerOutput -> ModelRunner.execute -> ModelRunnerOutput -> update()

There is no prefill or decode phase. Each running request computes min(missing, budget) tokens,
where missing = num_tokens - num_computed_tokens; prompt chunks and decode tokens share one
token budget per step. Ordering rules, applied in schedule():
  1. running requests first, in admission order (older first);
  2. when blocks run out, the newest running request is preempted (its blocks freed, its
     num_computed_tokens reset to 0; it recomputes prompt + output later and, having its own
     RNG, produces exactly what it would have);
  3. waiting requests are admitted in FIFO order, only if nothing was preempted this step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from isolab.config import SchedulerConfig
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # num_computed_tokens before this step: the first position computed
    num_new_tokens: int  # tokens [start, start + num_new_tokens) are computed this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so a token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()
    num_batched_tokens: int = 0


@dataclass
class Scheduler:
    config: SchedulerConfig
    kv: KVCacheManager
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    num_preemptions: int = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled_ids: set[str] = set()

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, f"request {req.request_id} is running with nothing to compute"
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                scheduled_ids.add(req.request_id)
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing after it can run either

        # 3. waiting requests, FIFO, only when nothing was preempted
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req)
            req.num_computed_tokens = num_hit
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                req.num_computed_tokens = 0
                break
            self.kv.count_admission(req, num_hit)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, num_hit, n))
            budget -= n

        return SchedulerOutput(
            tuple(chunks), tuple(preempted), self.config.max_num_batched_tokens - budget
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
