"""Owns the ingress's side of scale-out: N replicas behind one API, routed, watched and counted.

    Serving --submit(requests, scope)--> Router.route (scope, prompt, loads, up) -> replica i
            --> Ray Serve handle i: generate(...) streamed --> pump task --> the call's asyncio.Queue
    poller (every poll_s): stats() of each replica -> up/down, restarts (a new incarnation), figures

It answers the same calls as server.engine_loop.EngineLoop (server/backend.EngineBackend), so the
HTTP layer, tenants and formats are the same code with one engine or many.

Faults: a replica that dies mid-stream ends each of its unfinished requests with finish_reason
"error" and a sentence (the client gets a clean error, never a hang); it is marked down so new
requests go to the survivors, and a request whose replica dies before admitting it is tried on
another. Ray Serve restarts the replica; the poller sees the new incarnation, marks it up and makes
the router forget its prefixes (its cache is empty). Every engine request's in-flight count is
released when its stream ends, however it ends.

Only the ingress's event loop touches `_replicas`, the router and `_streams` (one writer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from isolab.engine.llm_engine import RequestOutput
from isolab.errors import EngineUnavailable, IsolabError, RequestAborted
from isolab.scaleout.router import DECISIONS, Router
from isolab.scaleout.wire import Admitted, Refused
from isolab.server.engine_loop import AdmissionBound, EngineRequest
from isolab.server.tenants import scope_owner

log = logging.getLogger("isolab.scaleout")

_SUMMED = ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "prefix_cache_queries_tokens",
           "prefix_cache_hits_tokens", "preemptions", "evictions", "audit_violations", "steps")


@dataclass
class _Replica:
    index: int
    handle: Any  # ray.serve.handle.DeploymentHandle
    up: bool = True
    inflight: int = 0  # engine requests routed here whose stream has not ended (the router's load)
    stats: dict[str, Any] = field(default_factory=dict)  # the last stats() answer
    incarnation: str | None = None
    restarts: int = 0
    failed_streams: int = 0


@dataclass
class _Stream:
    replica: _Replica
    response: Any  # DeploymentResponseGenerator
    request_ids: tuple[str, ...]
    pending: set[str]  # not yet finished
    task: asyncio.Task[None] | None = None
    cancelled: bool = False  # by abort() or stop(): what the stream raises next is ours, not a failure


class ReplicaSet(AdmissionBound):
    def __init__(self, handles: Sequence[Any], router: Router, poll_s: float = 0.5,
                 on_shutdown: Callable[[], None] | None = None,
                 death_errors: tuple[type[BaseException], ...] | None = None, admit_timeout_s: float = 30.0) -> None:
        """death_errors: what a call raises when its replica's process is gone (default: Ray's actor
        errors); any other error fails the request without marking the replica down."""
        super().__init__()
        self.death_errors = death_errors if death_errors is not None else _ray_death_errors()
        self.admit_timeout_s = admit_timeout_s
        assert len(handles) == router.num_replicas
        self.router = router
        self.poll_s = poll_s
        self._replicas = [_Replica(i, h) for i, h in enumerate(handles)]
        self._streams: dict[str, _Stream] = {}  # engine request id -> its stream
        self._poller: asyncio.Task[None] | None = None
        self._on_shutdown = on_shutdown
        self._stopping = False
        self.decisions: Counter | None = None  # set by register_metrics

    # -- the EngineBackend calls ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._stopping and any(r.up for r in self._replicas)

    def start(self) -> None:
        """Start watching the replicas (on the running event loop: the app's lifespan)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._poller is not None:
            self._poller.cancel()
        for stream in {id(s): s for s in self._streams.values()}.values():
            self._cancel(stream)

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Tear the deployment down (after the HTTP server has stopped); False if that did not finish
        within `timeout` seconds (Ray's own processes were signalled too, e.g. a terminal's Ctrl-C
        reaches the whole process group: its calls then retry for a minute)."""
        if self._on_shutdown is None:
            return True
        done = threading.Event()

        def run() -> None:
            try:
                self._on_shutdown()  # type: ignore[misc]
            except Exception as exc:  # the cluster is going away: say so, exit all the same
                log.warning("tearing the replicas down failed (%s)", type(exc).__name__)
            finally:
                done.set()

        threading.Thread(target=run, name="isolab-teardown", daemon=True).start()
        return done.wait(timeout)

    @property
    def stats(self) -> dict[str, float]:
        """The figures summed over the replicas that answered last (restarts reset a replica's counters)."""
        total = dict.fromkeys(_SUMMED, 0.0)
        for r in self._replicas:
            for key in _SUMMED:
                total[key] += float(r.stats.get(key, 0))
        return total

    @property
    def num_pending_commands(self) -> int:
        return 0  # submissions are awaited in place; nothing queues on the ingress

    async def submit(self, requests: Sequence[EngineRequest], cache_scope: str) -> asyncio.Queue[RequestOutput]:
        """Route the call (all its choices to one replica: they share the prompt's blocks) and start
        its stream. A replica that dies, stalls or is stopping before it admits the call is marked
        down and the next is tried; any other failure ends the call with a 503."""
        requests = tuple(requests)
        ids = tuple(r.request_id for r in requests)
        tried: set[int] = set()
        while True:
            up = [r.up and r.index not in tried for r in self._replicas]
            decision = self.router.route(cache_scope, requests[0].prompt_token_ids,
                                         [r.inflight for r in self._replicas], up, owner=scope_owner(cache_scope))
            if self._stopping:
                raise RequestAborted("the server is shutting down")
            if decision is None:
                raise EngineUnavailable("no engine replica is up; retry in a few seconds")
            if self.decisions is not None:
                self.decisions.labels(decision.kind).inc()
            replica = self._replicas[decision.replica]
            replica.inflight += len(ids)
            response = None
            try:
                response = replica.handle.options(stream=True).generate.remote(requests, cache_scope)
                first = await asyncio.wait_for(response.__anext__(), self.admit_timeout_s)
            except BaseException as exc:
                replica.inflight -= len(ids)
                if response is not None:
                    response.cancel()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                if not isinstance(exc, (TimeoutError, *self.death_errors)):
                    log.error("engine replica %d failed a call before admitting it (%s)", replica.index,
                              type(exc).__name__)
                    raise EngineUnavailable(f"engine replica {replica.index} failed this request; retry it") from None
                self._mark_down(replica, exc)  # dead (or silent past admit_timeout_s): the next one
                tried.add(replica.index)
                continue
            if isinstance(first, Refused):
                replica.inflight -= len(ids)
                if first.kind == "aborted":  # the replica is stopping (Serve replaces it): the next one
                    self._mark_down(replica, RequestAborted(first.message))
                    tried.add(replica.index)
                    continue
                raise first.error()
            assert isinstance(first, Admitted)
            self._note_incarnation(replica, first.incarnation)
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            stream = _Stream(replica, response, ids, set(ids))
            for rid in ids:
                self._streams[rid] = stream
            stream.task = asyncio.get_running_loop().create_task(self._pump(stream, queue))
            return queue

    def abort(self, request_ids: Sequence[str]) -> None:
        """Client gone: a stream all of whose requests are aborted is cancelled (the replica frees
        their blocks); a part of one is aborted on its replica."""
        by_stream: dict[int, tuple[_Stream, list[str]]] = {}
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None and rid in stream.pending:
                by_stream.setdefault(id(stream), (stream, []))[1].append(rid)
        for stream, rids in by_stream.values():
            if set(rids) >= stream.pending:
                self._cancel(stream)
            else:
                stream.replica.handle.abort.remote(rids)

    @staticmethod
    def _cancel(stream: _Stream) -> None:
        stream.cancelled = True  # first: Serve answers a cancelled stream with an error of its own
        stream.response.cancel()
        if stream.task is not None:
            stream.task.cancel()

    # -- streams -------------------------------------------------------------------------------------
    async def _pump(self, stream: _Stream, queue: asyncio.Queue[RequestOutput]) -> None:
        replica = stream.replica
        try:
            async for batch in stream.response:
                for out in batch:
                    if out.finished:
                        stream.pending.discard(out.request_id)
                    queue.put_nowait(out)
            if stream.pending:  # the stream ended early: never leave a consumer waiting
                raise IsolabError("the replica's stream ended before its requests did")
        except BaseException as exc:
            if stream.cancelled or isinstance(exc, asyncio.CancelledError):
                if self._stopping:  # shutdown: a consumer still reading gets its end, as one engine does it
                    self._finish(stream, queue, "abort", RequestAborted("the server is shutting down"))
                if not isinstance(exc, asyncio.CancelledError):
                    return  # Serve's own "request cancelled" error: we cancelled it, the replica is fine
                raise
            stream.response.cancel()
            replica.failed_streams += 1
            if isinstance(exc, self.death_errors):
                self._mark_down(replica, exc)
                message = f"engine replica {replica.index} stopped while serving this request; retry it"
            else:
                log.error("engine replica %d failed a stream (%s)", replica.index, type(exc).__name__)
                message = f"engine replica {replica.index} failed this request; retry it"
            self._finish(stream, queue, "error", EngineUnavailable(message))
        finally:
            replica.inflight -= len(stream.request_ids)
            for rid in stream.request_ids:
                self._streams.pop(rid, None)

    @staticmethod
    def _finish(stream: _Stream, queue: asyncio.Queue[RequestOutput], reason: str, error: IsolabError) -> None:
        """A final output for each request of the stream still unfinished."""
        for rid in sorted(stream.pending):
            queue.put_nowait(RequestOutput(rid, (), (), (), True, reason, None, 0, 0, error))
        stream.pending.clear()

    # -- health --------------------------------------------------------------------------------------
    def _mark_down(self, replica: _Replica, exc: BaseException) -> None:
        if replica.up:
            log.warning("engine replica %d is down (%s); routing around it", replica.index, type(exc).__name__)
        replica.up = False

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(r) for r in self._replicas))
            await asyncio.sleep(self.poll_s)

    async def _poll(self, replica: _Replica) -> None:
        response = replica.handle.stats.remote()
        try:
            stats = await asyncio.wait_for(response, timeout=max(2.0, 4 * self.poll_s))
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as exc:
            response.cancel()  # a timed-out call must not stay queued on the replica
            self._mark_down(replica, exc)
            return
        self._note_incarnation(replica, str(stats.get("incarnation")))
        if not replica.up:
            log.warning("engine replica %d is up", replica.index)
        replica.stats, replica.up = stats, True

    def _note_incarnation(self, replica: _Replica, incarnation: str) -> None:
        """A new incarnation is a restarted actor: its cache is empty, so the router forgets it."""
        if replica.incarnation is not None and incarnation != replica.incarnation:
            replica.restarts += 1
            self.router.forget_replica(replica.index)
            log.warning("engine replica %d restarted (restart %d)", replica.index, replica.restarts)
        replica.incarnation = incarnation

    async def refresh(self) -> None:
        """One poll of every replica now (the first figures, before the poller's first turn)."""
        await asyncio.gather(*(self._poll(r) for r in self._replicas))

    # -- reporting -----------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """/health's per-replica lines: state and counts only (no prompts, no tenants)."""
        return {"replicas": [{"replica": r.index, "up": r.up, "pid": r.stats.get("pid"), "restarts": r.restarts,
                              "inflight": r.inflight, "running": r.stats.get("running", 0)} for r in self._replicas],
                "routing": self.router.config.policy, "admitted": self._reserved}

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("isolab_routing_decisions", "routing decisions by kind (affinity = the prefix's "
                                 "replica took it)", ["decision"], registry=registry)
        for kind in DECISIONS:
            self.decisions.labels(kind)
        registry.register(_ReplicaCollector(self))


def _ray_death_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors for a call whose actor is gone (or unreachable for now)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.rs = replicas

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        reps = self.rs._replicas
        figures: list[tuple[str, str, Callable[[_Replica], float], bool]] = [
            ("isolab_replica_up", "1 if the replica answers", lambda r: float(r.up), False),
            ("isolab_replica_inflight", "engine requests routed to the replica and not finished",
             lambda r: float(r.inflight), False),
            ("isolab_replica_requests_running", "engine requests the replica is computing",
             lambda r: float(r.stats.get("running", 0)), False),
            ("isolab_replica_kv_blocks_used", "KV blocks the replica holds", lambda r: float(r.stats.get("kv_blocks_used", 0)), False),
            ("isolab_replica_prefix_cache_hit_rate", "prompt tokens served from the replica's prefix cache / looked up",
             lambda r: float(r.stats.get("prefix_cache_hits_tokens", 0)) / max(1.0, float(r.stats.get("prefix_cache_queries_tokens", 0))), False),
            ("isolab_replica_prefix_cache_hits_tokens", "prompt tokens served from the replica's prefix cache",
             lambda r: float(r.stats.get("prefix_cache_hits_tokens", 0)), True),
            ("isolab_replica_restarts", "times the replica came back with a new incarnation", lambda r: float(r.restarts), True),
            ("isolab_replica_failed_streams", "streams cut by the replica's failure", lambda r: float(r.failed_streams), True),
        ]
        for name, doc, value, counter in figures:
            fam: GaugeMetricFamily | CounterMetricFamily = (CounterMetricFamily(name, doc, labels=["replica"]) if counter
                                                            else GaugeMetricFamily(name, doc, labels=["replica"]))
            for r in reps:
                fam.add_metric([str(r.index)], value(r))
            yield fam
        yield GaugeMetricFamily("isolab_replicas_up", "replicas that answer", value=float(sum(r.up for r in reps)))
