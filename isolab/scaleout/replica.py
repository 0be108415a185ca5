"""Owns one engine replica: an LLMEngine and its EngineLoop inside a Ray Serve replica actor.

    ingress --channel(cid)--> Admitted, then per engine step one list of every output of every
                              call added on that channel (one stream per ingress, not one per call:
                              a Ray message per step instead of one per call per step)
    ingress --add(requests, scope, cid)--> Admitted | Refused   (outputs then flow on the channel)
    ingress --abort(ids)-->   each gets a final 'abort' output on its channel; blocks freed
    ingress --stats()-->      the engine's stats snapshot + pid + incarnation (one per actor start)
    Serve   --check_health()--> raises when the engine thread has stopped (Serve then restarts us)

Nothing crosses the wire but plain data: errors become (kind, message, field) and are rebuilt on
the ingress (wire.py), so an exception that does not pickle cannot turn into a hang. A channel that
closes (its ingress went away, or cancelled it) aborts every unfinished request added on it.
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
        # This actor's event loop only: channel id -> the queue its stream reads; request id -> its channel.
        self._channels: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._owner: dict[str, str] = {}
        log.info("replica %d up (pid %d, %d thread(s))", index, os.getpid(), threads)

    def facts(self) -> ReplicaFacts:
        e = self.engine
        return ReplicaFacts(path=str(e.bundle.path), name=e.bundle.name, fingerprint=e.bundle.fingerprint,
                            arch=e.bundle.hparams.arch, vocab_size=e.bundle.hparams.vocab_size,
                            max_model_len=e.max_request_tokens, max_num_seqs=e.config.scheduler.max_num_seqs,
                            numerics=e.numerics)

    def stats(self) -> dict[str, float | str]:
        return {**self.loop.stats, "pid": os.getpid(), "incarnation": self.incarnation}

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError(f"replica {self.index}: the engine thread has stopped")

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests (the rest of their calls go on): each gets a final 'abort' output."""
        self.loop.abort(request_ids)
        for rid in request_ids:
            cid = self._owner.get(rid)
            queue = self._channels.get(cid) if cid is not None else None
            if queue is not None:
                queue.put_nowait(RequestOutput(rid, (), (), (), True, "abort", None, 0, 0, None))

    async def channel(self, channel_id: str) -> AsyncIterator[object]:
        """Admitted first (this incarnation), then per engine step the outputs of the channel's calls."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._channels[channel_id] = queue
        try:
            yield Admitted(self.index, self.incarnation)
            while True:
                batch = [await queue.get()]
                while not queue.empty():  # one message per step, not per token or per call
                    batch.append(queue.get_nowait())
                batch = [o for o in batch if self._owner.get(o.request_id) == channel_id]  # (an abort racing a finish)
                for out in batch:
                    if out.finished:
                        del self._owner[out.request_id]
                if batch:
                    yield [to_wire(o) for o in batch]
        finally:
            del self._channels[channel_id]
            mine = sorted(rid for rid, cid in self._owner.items() if cid == channel_id)
            for rid in mine:
                del self._owner[rid]
            if mine:  # the ingress went away (or cancelled the channel): free their blocks now
                self.loop.abort(mine)

    async def add(self, requests: tuple[EngineRequest, ...], scope: str, channel_id: str) -> Admitted | Refused:
        """Admit a call (all its requests or none); its outputs flow on the channel."""
        queue = self._channels.get(channel_id)
        if queue is None:
            return Refused("no-channel", "this replica has no such channel (it restarted)", None)
        for r in requests:  # before the submit: the first output may come before we resume
            self._owner[r.request_id] = channel_id
        try:
            await self.loop.submit(requests, scope, queue)
        except (InvalidRequestError, RequestAborted) as exc:
            for r in requests:
                self._owner.pop(r.request_id, None)
            return Refused.of(exc)
        return Admitted(self.index, self.incarnation)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=5.0)
