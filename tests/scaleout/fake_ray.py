"""Stand-ins for Ray Serve's handles around real EngineReplica objects, in one process: the ingress's
code paths (routing, streams, deaths, restarts) run for real, on the tiny model, without Ray."""

from __future__ import annotations

import asyncio
from typing import Any

from isolab.config import EngineConfig
from isolab.scaleout.replica import EngineReplica


class ActorDied(Exception):
    """What Ray raises when the actor behind a call is gone (ray.exceptions.ActorDiedError)."""


class FakeResponse:
    """A streaming response: the replica's generator runs in its own task (as in its actor)."""

    def __init__(self, replica: FakeReplica, agen: Any) -> None:
        self.replica = replica
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
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
        if self.replica.dead:
            raise ActorDied("the actor died unexpectedly before finishing this task")
        kind, item = await self.queue.get()
        if kind == "dead":
            raise ActorDied("the actor died unexpectedly before finishing this task")
        if kind == "end":
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.task.cancel()


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeReplica:
    """Looks like a DeploymentHandle to one replica; kill() and restart() play Ray's part."""

    def __init__(self, config: EngineConfig, index: int) -> None:
        self.config, self.index = config, index
        self.replica = EngineReplica(config, index, threads=1)
        self.dead = False
        self.responses: list[FakeResponse] = []
        self.generate = _Method(self._generate)
        self.stats = _Method(self._stats)
        self.abort = _Method(lambda ids: asyncio.ensure_future(self.replica.abort(ids)))

    def options(self, **kw: Any) -> FakeReplica:
        return self

    def _generate(self, requests: Any, scope: str) -> FakeResponse:
        return FakeResponse(self, self.replica.generate(requests, scope))

    async def _stats(self) -> dict[str, Any]:
        if self.dead:
            raise ActorDied("the actor is dead")
        return self.replica.stats()

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
