"""Owns one engine replica: an LLMEngine and its EngineLoop inside a Ray Serve replica actor.

    ingress --generate(requests, scope)--> Admitted | Refused, then lists of RequestOutput, streamed
    ingress --stats()-->  the engine's stats snapshot + pid + incarnation (one per actor start)
    Serve   --check_health()--> raises when the engine thread has stopped (Serve then restarts us)

Nothing crosses the wire but plain data: errors become (kind, message, field) and are rebuilt on
the ingress (wire.py), so an exception that does not pickle cannot turn into a hang. A stream the
ingress cancels (client gone) aborts its unfinished engine requests here: their blocks are freed.
Does not know routing, HTTP or tenants (the scope arrives as an opaque string).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator

from isolab.config import EngineConfig
from isolab.engine.llm_engine import RequestOutput
from isolab.errors import InvalidRequestError, RequestAborted
from isolab.scaleout.wire import Admitted, Refused, ReplicaFacts, to_wire
from isolab.server.engine_loop import EngineLoop, EngineRequest

log = logging.getLogger("isolab.replica")


class EngineReplica:
    """The class Ray Serve deploys (replica_set.deploy wraps it in serve.deployment)."""

    def __init__(self, config: EngineConfig, index: int, threads: int) -> None:
        import torch

        from isolab.engine.llm_engine import LLMEngine

        torch.set_num_threads(threads)  # also the OpenMP pool of isolab's kernels
        self.index = index
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted replica has another: the ingress sees it
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(self.engine)
        self.loop.start()
        # request id -> the queue its stream reads (this actor's event loop only): abort() ends it there
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        log.info("replica %d up (pid %d, %d thread(s))", index, os.getpid(), threads)

    def facts(self) -> ReplicaFacts:
        e = self.engine
        return ReplicaFacts(path=str(e.bundle.path), name=e.bundle.name, fingerprint=e.bundle.fingerprint,
                            arch=e.bundle.hparams.arch, vocab_size=e.bundle.hparams.vocab_size,
                            max_model_len=e.max_model_len, max_num_seqs=e.config.scheduler.max_num_seqs,
                            numerics=e.model.numerics)

    def stats(self) -> dict[str, float | str]:
        return {**self.loop.stats, "pid": os.getpid(), "incarnation": self.incarnation,
                "reserved": self.loop.num_reserved}

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError(f"replica {self.index}: the engine thread has stopped")

    async def abort(self, request_ids: list[str]) -> None:
        """Abort some of a stream's requests (the rest go on): each gets a final 'abort' output."""
        self.loop.abort(request_ids)
        for rid in request_ids:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(RequestOutput(rid, (), (), (), True, "abort", None, 0, 0, None))

    async def generate(self, requests: tuple[EngineRequest, ...], scope: str) -> AsyncIterator[object]:
        """Admitted or Refused first; then, per engine step, the outputs that step produced."""
        try:
            queue = await self.loop.submit(requests, scope)
        except (InvalidRequestError, RequestAborted) as exc:
            yield Refused.of(exc)
            return
        pending = {r.request_id for r in requests}
        for rid in pending:
            self._queues[rid] = queue
        try:
            yield Admitted(self.index, self.incarnation)
            while pending:
                batch = [await queue.get()]
                while not queue.empty():  # one message per step, not per token
                    batch.append(queue.get_nowait())
                batch = [o for o in batch if o.request_id in pending]  # (an abort racing a finish)
                for out in batch:
                    if out.finished:
                        pending.discard(out.request_id)
                yield [to_wire(o) for o in batch]
        finally:
            for rid in requests:
                self._queues.pop(rid.request_id, None)
            if pending:  # cancelled by the ingress (client gone, or shutdown): free the blocks now
                self.loop.abort(sorted(pending))

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=5.0)
