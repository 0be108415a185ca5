"""Owns the bridge between asyncio and the single-threaded engine: one thread drives the engine.

    asyncio handlers --submit/abort--> command deque (+ condition) --> engine thread
    engine thread: apply commands (add_request / abort) -> step() -> outputs
    outputs --loop.call_soon_threadsafe--> one asyncio.Queue per engine request

Only the engine thread calls add_request / abort / step. It sleeps on the condition when it has
no command and no unfinished request (no busy spin). `stats` is a snapshot of engine.stats() that
the thread replaces after every step, so other threads never read engine internals.
Does not know HTTP, tenants or the OpenAI formats.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVarTuple

import torch
from prometheus_client import CollectorRegistry

from isolab.engine.llm_engine import LLMEngine, RequestOutput
from isolab.engine.omp_pool import adopt_thread_count, release_thread_pool, team_size
from isolab.errors import IsolabError, RequestAborted
from isolab.sampling_params import SamplingParams

log = logging.getLogger("isolab.server")


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


@dataclass(frozen=True)
class _Add:
    requests: tuple[EngineRequest, ...]
    cache_scope: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]
    admitted: asyncio.Future[None]


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


def _final(request_id: str, reason: str, error: IsolabError | None) -> RequestOutput:
    return RequestOutput(request_id, (), (), (), True, reason, None, 0, 0, error)


class AdmissionBound:
    """The server's bound on engine requests in flight, counted on the asyncio side: reserve before
    submit, release when the call's reply ends (one engine or many share the bookkeeping)."""

    def __init__(self) -> None:
        self._reserved = 0
        self.peak_reserved = 0  # high-water mark (tests and metrics)
        self._reserve_lock = threading.Lock()

    @property
    def num_reserved(self) -> int:
        return self._reserved

    def try_reserve(self, n: int, capacity: int) -> bool:
        with self._reserve_lock:
            if self._reserved + n > capacity:
                return False
            self._reserved += n
            self.peak_reserved = max(self.peak_reserved, self._reserved)
            return True

    def release(self, n: int) -> None:
        with self._reserve_lock:
            self._reserved -= n
            assert self._reserved >= 0


class EngineLoop(AdmissionBound):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: deque[_Add | _Abort] = deque()
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="isolab-engine", daemon=True)
        self.stats: dict[str, float] = dict(engine.stats())
        self.num_pending_commands = 0  # submissions and aborts the engine thread has not taken yet
        self.num_pending_requests = 0  # the requests those submissions carry (the waiting gauge counts them)
        self._threads = 1
        self.team_size = 0  # the engine thread's OpenMP team size, once it runs (omp_pool)
        self._builder = threading.get_ident()  # the thread that built the engine holds its OpenMP pool
        self._start_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self._thread.ident is not None:  # once: a second call (the app's lifespan) is a no-op
                return
            # The engine was built on this thread, which holds an OpenMP pool from the model load and
            # the start-up check; two pools on the cores make every kernel barrier sleep (omp_pool).
            if threading.get_ident() != self._builder:
                log.info("engine loop started on another thread than the one that made it: its OpenMP pool "
                         "stays (engine/omp_pool.py); start it where the engine was built")
            release_thread_pool()
            self._threads = torch.get_num_threads()  # the count the builder gave torch (a replica's --replica-threads)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left (its consumers get finish_reason 'abort') and join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def describe(self) -> dict[str, Any]:
        return {}  # one engine: /health says all there is

    def register_metrics(self, registry: CollectorRegistry) -> None:
        pass  # the engine's figures are ServerMetrics' own

    # -- asyncio side --------------------------------------------------------------------------------
    async def submit(
        self, requests: Sequence[EngineRequest], cache_scope: str, queue: asyncio.Queue[RequestOutput] | None = None
    ) -> asyncio.Queue[RequestOutput]:
        """Add the requests (all or none); their outputs arrive, in step order, on the one queue
        returned (`queue` when given: a scale-out replica multiplexes many calls onto one). Raises
        the engine's InvalidRequestError if it refuses any of them."""
        loop = asyncio.get_running_loop()
        queue = queue if queue is not None else asyncio.Queue()
        admitted: asyncio.Future[None] = loop.create_future()
        self._push(_Add(tuple(requests), cache_scope, loop, queue, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort([r.request_id for r in requests])  # FIFO: the abort lands after the add
            raise
        return queue

    def abort(self, request_ids: Sequence[str]) -> None:
        """Cancel requests; their blocks are freed by the engine thread at its next turn."""
        if request_ids:
            self._push(_Abort(tuple(request_ids)))

    def _push(self, cmd: _Add | _Abort) -> None:
        with self._cv:
            if self._stopping and isinstance(cmd, _Add):
                raise RequestAborted("the server is shutting down")
            self._commands.append(cmd)
            self.num_pending_commands = len(self._commands)
            if isinstance(cmd, _Add):
                self.num_pending_requests += len(cmd.requests)
            self._cv.notify()

    # -- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:  # a new thread's teams start at the CPU count (omp_pool); serving matters more than this
            adopt_thread_count(self._threads)
            self.team_size = team_size()
        except Exception:
            log.exception("could not set the engine thread's OpenMP thread count")
        engine = self.engine
        while True:
            with self._cv:
                while not self._commands and not self._stopping and not engine.has_unfinished():
                    self._cv.wait()
                commands = list(self._commands)
                self._commands.clear()
                self.num_pending_commands = self.num_pending_requests = 0
                stopping = self._stopping
            for cmd in commands:
                if isinstance(cmd, _Add):
                    self._apply_add(cmd)
                else:
                    for rid in cmd.request_ids:
                        if self._routes.pop(rid, None) is not None:
                            engine.abort(rid)
            if stopping:
                self._fail_all("abort", RequestAborted("the server is shutting down"))
                self.stats = dict(engine.stats())
                return
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception:  # a bug: fail the requests in flight, keep serving
                    log.exception("engine step failed; failing %d request(s)", len(self._routes))
                    self._fail_all("error", IsolabError("internal engine error"))
                    outputs = []
                self._dispatch(outputs)
            self.stats = dict(engine.stats())

    def _apply_add(self, cmd: _Add) -> None:
        added: list[str] = []
        try:
            for r in cmd.requests:
                self.engine.add_request(r.request_id, list(r.prompt_token_ids), r.params, cmd.cache_scope)
                added.append(r.request_id)
        except Exception as exc:
            for rid in added:
                self.engine.abort(rid)
            _call(cmd.loop, _settle, cmd.admitted, exc)
            return
        for rid in added:
            self._routes[rid] = _Route(cmd.loop, cmd.queue)
        _call(cmd.loop, _settle, cmd.admitted, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]] = {}
        for o in outputs:
            route = self._routes.pop(o.request_id, None) if o.finished else self._routes.get(o.request_id)
            if route is not None:
                batches.setdefault(route.loop, []).append((route.queue, o))
        for loop, batch in batches.items():
            _call(loop, _deliver, batch)

    def _fail_all(self, reason: str, error: IsolabError) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]] = {}
        for rid, route in list(self._routes.items()):
            self.engine.abort(rid)
            batches.setdefault(route.loop, []).append((route.queue, _final(rid, reason, error)))
        self._routes.clear()
        for loop, batch in batches.items():
            _call(loop, _deliver, batch)


Ts = TypeVarTuple("Ts")


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[[*Ts], None], *args: *Ts) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _deliver(batch: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for queue, output in batch:
        queue.put_nowait(output)
