"""Owns the ingress's side of scale-out: N replicas behind one API, routed, watched and counted.

    Serving --submit(requests, scope)--> Router.route (scope, prompt, loads, up) -> replica i
            --> handle i: add(requests, scope, cid) --> Admitted | Refused
    one channel per replica (handle i: channel(cid), streamed): per engine step one message with
            the outputs of every call on it --> reader task --> each call's asyncio.Queue
    poller (every poll_s): stats() of each replica -> up/down, restarts (a new incarnation), figures

It answers the same calls as server.engine_loop.EngineLoop (server/backend.EngineBackend), so the
HTTP layer, tenants and formats are the same code with one engine or many. One channel per replica
rather than one stream per call: a Ray message per step, not one per call per step (the Ray hop's
cost grew with the number of calls; bench/replicas.py).

Faults: a replica that dies ends each of its unfinished requests with finish_reason "error" and a
sentence (the client gets a clean error, never a hang); it is marked down so new requests go to
the survivors, and a call whose replica dies (or stays silent for admit_timeout_s, or is stopping)
before admitting it is tried on another. Ray Serve restarts the replica; the poller sees the new
incarnation, marks it up and makes the router forget its prefixes (its cache is empty); the next
call opens a new channel. Every engine request's in-flight count is released when it finishes,
is aborted, or its channel fails.

Only the ingress's event loop touches `_replicas`, their channels and the router (one writer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
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
from isolab.server.metrics import ENGINE_FIGURES
from isolab.server.tenants import scope_owner

log = logging.getLogger("isolab.scaleout")

# the engine figures the server reports (and the queue length): summed over the replicas
_SUMMED = (*(key for key, *_ in ENGINE_FIGURES), "waiting")


@dataclass
class _Channel:
    """One replica incarnation's stream of outputs to this ingress."""
    response: Any  # DeploymentResponseGenerator of EngineReplica.channel
    routes: dict[str, asyncio.Queue[RequestOutput]] = field(default_factory=dict)  # unfinished request -> its call's queue
    task: asyncio.Task[None] | None = None  # the reader
    cancelled: bool = False  # by stop(): what the stream raises next is ours, not a failure


@dataclass
class _Replica:
    index: int
    handle: Any  # ray.serve.handle.DeploymentHandle
    up: bool = True
    inflight: int = 0  # engine requests routed here and not finished (the router's load); == len(channel.routes)
    stats: dict[str, Any] = field(default_factory=dict)  # the last stats() answer
    incarnation: str | None = None
    restarts: int = 0
    failed_requests: int = 0  # engine requests cut by the replica's failure
    channel: _Channel | None = None
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)  # one channel open at a time


CLUSTER_LOST = ("the Ray instance this server started has stopped (one of its processes exited): no engine "
                "replica can come back; restart isolab serve")


class ReplicaSet(AdmissionBound):
    def __init__(self, handles: Sequence[Any], router: Router, poll_s: float = 0.5,
                 on_shutdown: Callable[[], None] | None = None,
                 death_errors: tuple[type[BaseException], ...] | None = None, admit_timeout_s: float = 30.0,
                 cluster_gone: Callable[[], bool] = lambda: False) -> None:
        """death_errors: what a call raises when its replica's process is gone (default: Ray's actor
        errors); any other error fails the request without marking the replica down. cluster_gone:
        whether what runs the replicas has stopped for good (the server's own Ray instance exited), so
        that none can come back."""
        super().__init__()
        self.death_errors = death_errors if death_errors is not None else _ray_death_errors()
        self.admit_timeout_s = admit_timeout_s
        assert len(handles) == router.num_replicas
        self.router = router
        self.poll_s = poll_s
        self.channel_id = uuid.uuid4().hex  # this ingress's name on every replica
        self._replicas = [_Replica(i, h) for i, h in enumerate(handles)]
        self._poller: asyncio.Task[None] | None = None
        self._on_shutdown = on_shutdown
        self._cluster_gone = cluster_gone
        self.cluster_lost = False  # set once every replica is down and cluster_gone() says so
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
        """Shutdown: every call still reading gets its end ('abort'), as one engine does it."""
        self._stopping = True
        if self._poller is not None:
            self._poller.cancel()
        for replica in self._replicas:
            channel = replica.channel
            if channel is not None:
                channel.cancelled = True
                channel.response.cancel()  # the replica aborts what was added on it
                if channel.task is not None:
                    channel.task.cancel()
                self._fail_routes(replica, channel, "abort", RequestAborted("the server is shutting down"))

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

    @property
    def num_pending_requests(self) -> int:
        return 0  # (as num_pending_commands)

    async def submit(self, requests: Sequence[EngineRequest], cache_scope: str) -> asyncio.Queue[RequestOutput]:
        """Route the call (all its choices to one replica: they share the prompt's blocks) and add it
        there. A replica that dies, stays silent or is stopping before it admits the call is marked
        down and the next is tried; any other failure ends the call with a 503."""
        requests = tuple(requests)
        ids = tuple(r.request_id for r in requests)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        tried: set[int] = set()
        while True:
            up = [r.up and r.index not in tried for r in self._replicas]
            decision = self.router.route(cache_scope, requests[0].prompt_token_ids,
                                         [r.inflight for r in self._replicas], up, owner=scope_owner(cache_scope))
            if self._stopping:
                raise RequestAborted("the server is shutting down")
            if decision is None:
                if self.cluster_lost:  # ("retry in a few seconds" promised what cannot come)
                    raise EngineUnavailable(CLUSTER_LOST)
                raise EngineUnavailable("no engine replica is up; retry in a few seconds")
            if self.decisions is not None:
                self.decisions.labels(decision.kind).inc()
            replica = self._replicas[decision.replica]
            try:
                channel = await self._channel(replica)
            except Exception as exc:
                self._try_another(replica, exc, tried)
                continue
            for rid in ids:  # routes first: outputs may arrive on the channel before add() returns
                channel.routes[rid] = queue
            replica.inflight += len(ids)
            response = None
            try:
                response = replica.handle.add.remote(requests, cache_scope, self.channel_id)
                answer = await asyncio.wait_for(response, self.admit_timeout_s)
            except BaseException as exc:
                self._unroute(replica, channel, ids)
                if response is not None:
                    response.cancel()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                self._try_another(replica, exc, tried)
                continue
            if isinstance(answer, Refused):
                self._unroute(replica, channel, ids)
                if answer.kind in ("aborted", "no-channel"):  # stopping, or restarted under our channel
                    self._mark_down(replica, RequestAborted(answer.message))
                    tried.add(replica.index)
                    continue
                raise answer.error()
            assert isinstance(answer, Admitted)
            return queue

    def abort(self, request_ids: Sequence[str]) -> None:
        """Client gone: the requests are aborted on their replica (their blocks freed there); their
        outputs are dropped from now on."""
        by_replica: dict[int, list[str]] = {}
        for replica in self._replicas:
            channel = replica.channel
            if channel is None:
                continue
            mine = [rid for rid in request_ids if rid in channel.routes]
            if mine:
                self._unroute(replica, channel, mine)
                by_replica[replica.index] = mine
        for index, rids in by_replica.items():
            self._replicas[index].handle.abort.remote(rids)

    # -- channels ------------------------------------------------------------------------------------
    async def _channel(self, replica: _Replica) -> _Channel:
        """The replica's open channel, opened (and its reader started) if it has none."""
        async with replica.opening:
            if replica.channel is not None:
                return replica.channel
            response = replica.handle.options(stream=True).channel.remote(self.channel_id)
            try:
                hello = await asyncio.wait_for(response.__anext__(), self.admit_timeout_s)
            except BaseException:
                response.cancel()
                raise
            assert isinstance(hello, Admitted)
            self._note_incarnation(replica, hello.incarnation)
            channel = replica.channel = _Channel(response)
            channel.task = asyncio.get_running_loop().create_task(self._read(replica, channel))
            return channel

    async def _read(self, replica: _Replica, channel: _Channel) -> None:
        try:
            async for batch in channel.response:
                for out in batch:
                    queue = channel.routes.get(out.request_id)
                    if queue is None:
                        continue  # aborted here already
                    if out.finished:
                        self._unroute(replica, channel, (out.request_id,))
                    queue.put_nowait(out)
            raise IsolabError("the replica closed its channel")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if channel.cancelled:
                return  # stop() cancelled it: Serve's "request cancelled" error is ours
            if replica.channel is channel:
                replica.channel = None  # the next call opens a new one
            if isinstance(exc, self.death_errors):
                self._mark_down(replica, exc)
                message = f"engine replica {replica.index} stopped while serving this request; retry it"
            else:
                log.error("engine replica %d: its channel failed (%s)", replica.index, type(exc).__name__)
                message = f"engine replica {replica.index} failed this request; retry it"
            channel.response.cancel()
            replica.failed_requests += len(channel.routes)
            self._fail_routes(replica, channel, "error", EngineUnavailable(message))

    def _unroute(self, replica: _Replica, channel: _Channel, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if channel.routes.pop(rid, None) is not None:
                replica.inflight -= 1

    def _fail_routes(self, replica: _Replica, channel: _Channel, reason: str, error: IsolabError) -> None:
        """A final output for every request still routed on the channel; none stays counted."""
        for rid, queue in sorted(channel.routes.items()):
            queue.put_nowait(RequestOutput(rid, (), (), (), True, reason, None, 0, 0, error))
        self._unroute(replica, channel, list(channel.routes))

    def _try_another(self, replica: _Replica, exc: BaseException, tried: set[int]) -> None:
        """Before admission: a replica that died, stayed silent or is stopping is marked down and left
        out of this call's next route; any other error fails the call (raised here)."""
        if not isinstance(exc, (TimeoutError, *self.death_errors)):
            raise self._failed_call(replica, exc) from None
        self._mark_down(replica, exc)
        tried.add(replica.index)

    def _failed_call(self, replica: _Replica, exc: BaseException) -> EngineUnavailable:
        """An error that is no death (a bug, a Ray failure): the call fails, the replica stays up."""
        log.error("engine replica %d failed a call (%s)", replica.index, type(exc).__name__)
        return EngineUnavailable(f"engine replica {replica.index} failed this request; retry it")

    # -- health --------------------------------------------------------------------------------------
    def _mark_down(self, replica: _Replica, exc: BaseException) -> None:
        if replica.up:
            log.warning("engine replica %d is down (%s); routing around it", replica.index, type(exc).__name__)
        replica.up = False

    async def _poll_forever(self) -> None:
        while True:
            await self.refresh()
            if not self.cluster_lost and not any(r.up for r in self._replicas) and self._cluster_gone():
                self.cluster_lost = True
                log.error(CLUSTER_LOST)
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
                "routing": self.router.config.policy, "admitted": self._reserved,
                **({"error": CLUSTER_LOST} if self.cluster_lost else {})}

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
            ("isolab_replica_failed_requests", "engine requests cut by the replica's failure",
             lambda r: float(r.failed_requests), True),
        ]
        for name, doc, value, counter in figures:
            fam: GaugeMetricFamily | CounterMetricFamily = (CounterMetricFamily(name, doc, labels=["replica"]) if counter
                                                            else GaugeMetricFamily(name, doc, labels=["replica"]))
            for r in reps:
                fam.add_metric([str(r.index)], value(r))
            yield fam
        yield GaugeMetricFamily("isolab_replicas_up", "replicas that answer", value=float(sum(r.up for r in reps)))
