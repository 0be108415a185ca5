"""Stand-ins for Ray Serve's handles around real EngineReplica objects, in one process: the ingress's
code paths (routing, streams, deaths, restarts) run for real, on the tiny model, without Ray."""

from __future__ import annotations

import asyncio
from typing import Any

from isolab.config import EngineConfig
from isolab.scaleout.replica import EngineReplica


class ActorDied(Exception):
    """What Ray raises when the actor behind a call is gone (ray.exceptions.ActorDiedError)."""


class RequestCancelled(Exception):
    """What Serve raises from a stream after its cancel() (ray.serve.exceptions.RequestCancelledError):
    an ordinary Exception, not asyncio's CancelledError."""


class FakeResponse:
    """A streaming response: the replica's generator runs in its own task (as in its actor). A dead
    replica's response never runs anything: it fails at its first item."""

    def __init__(self, replica: FakeReplica, agen: Any) -> None:
        self.replica = replica
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = False
        if replica.dead:
            self.task = None
            self.queue.put_nowait(("dead", None))
        else:
            self.task = asyncio.get_running_loop().create_task(self._drive(agen))
            replica.responses.append(self)

    async def _drive(self, agen: Any) -> None:
        try:
            async for item in agen:
                self.queue.put_nowait(("item", item))
            self.queue.put_nowait(("end", None))
        finally:
            await agen.aclose()

    def __aiter__(self) -> FakeResponse:
        return self

    async def __anext__(self) -> Any:
        if self.cancelled:
            raise RequestCancelled("the request was cancelled")
        kind, item = await self.queue.get()
        if kind == "dead":
            raise ActorDied("the actor died unexpectedly before finishing this task")
        if kind == "cancelled":
            raise RequestCancelled("the request was cancelled")
        if kind == "end":
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()
        self.queue.put_nowait(("cancelled", None))


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeReplica:
    """Looks like a DeploymentHandle to one replica; kill() and restart() play Ray's part."""

    def __init__(self, config: EngineConfig, index: int) -> None:
        self.config, self.index = config, index
        self.replica = EngineReplica(config, index, threads=1)
        self.dead = False
        self.fail_with: Exception | None = None  # calls fail with this (an application error, not a death)
        self.stalled = False  # add() never answers
        self.num_calls = 0
        self.responses: list[FakeResponse] = []
        self.channel = _Method(self._channel)
        self.add = _Method(self._add)
        self.stats = _Method(self._stats)
        self.abort = _Method(lambda ids: asyncio.ensure_future(self.replica.abort(ids)))

    def options(self, **kw: Any) -> FakeReplica:
        return self

    def _channel(self, channel_id: str) -> FakeResponse:
        self.num_calls += 1
        return FakeResponse(self, self.replica.channel(channel_id))

    def _add(self, requests: Any, scope: str, channel_id: str) -> asyncio.Task[Any]:
        self.num_calls += 1

        async def call() -> Any:
            if self.dead:
                raise ActorDied("the actor is dead")
            if self.fail_with is not None:
                raise self.fail_with
            if self.stalled:
                await asyncio.Event().wait()  # alive but never answers
            return await self.replica.add(requests, scope, channel_id)
        return asyncio.ensure_future(call())  # like a DeploymentResponse: awaitable, cancellable

    def _stats(self) -> asyncio.Task[dict[str, Any]]:
        async def call() -> dict[str, Any]:
            if self.dead:
                raise ActorDied("the actor is dead")
            return self.replica.stats()
        return asyncio.ensure_future(call())  # like a DeploymentResponse: awaitable, cancellable

    def kill(self) -> None:
        """The process is gone: its streams break, its calls fail (its engine is simply dropped)."""
        self.dead = True
        for r in self.responses:
            r.task.cancel()
            r.queue.put_nowait(("dead", None))
        self.responses.clear()
        self.replica.loop.stop()

    def restart(self) -> None:
        self.replica = EngineReplica(self.config, self.index, threads=1)
        self.dead = False
