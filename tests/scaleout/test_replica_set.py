"""The ingress's side of scale-out (scaleout/replica_set.py) over real EngineReplicas on the tiny
model, with Ray's handles played in-process (fake_ray.py): streams, routing, a replica that dies
mid-stream or before admitting, restarts, aborts, refusals, and nothing left counted."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from isolab.config import CacheConfig, EngineConfig, MiB, SchedulerConfig
from isolab.errors import EngineUnavailable, PromptTooLongError
from isolab.sampling_params import SamplingParams
from isolab.scaleout.replica_set import ReplicaSet
from isolab.scaleout.router import Router, RoutingConfig
from isolab.server.engine_loop import EngineRequest
from tests.scaleout.fake_ray import ActorDied, FakeReplica


@pytest.fixture
def fakes(tiny_path, tiny_bundle):
    config = EngineConfig(model=str(tiny_path), device="cpu", cache=CacheConfig(16, 8 * MiB, True),
                          scheduler=SchedulerConfig(8, 256))
    threads = torch.get_num_threads()
    reps = [FakeReplica(config, i) for i in range(2)]  # each sets torch's threads to 1, as a real replica does
    yield reps
    for r in reps:
        r.replica.loop.stop()
    torch.set_num_threads(threads)  # in-process fakes: leave the process's count as it was


def make_set(fakes) -> ReplicaSet:
    return ReplicaSet(fakes, Router(len(fakes), RoutingConfig(block_size=16)), poll_s=0.05, death_errors=(ActorDied,))


def req(rid: str, n_prompt: int = 40, max_tokens: int = 8, seed: int = 0) -> EngineRequest:
    return EngineRequest(rid, tuple((seed * 7 + i) % 200 + 3 for i in range(n_prompt)),
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def drain(queue, ids):
    outs, pending = [], set(ids)
    while pending:
        o = await asyncio.wait_for(queue.get(), 30)
        outs.append(o)
        if o.finished:
            pending.discard(o.request_id)
    return outs


def home_of(rs: ReplicaSet, rid: str) -> int:
    """The replica whose channel carries the request (while it is unfinished: ask right after submit,
    of a request long enough not to have finished while submit awaited its admission)."""
    (index,) = [r.index for r in rs._replicas if r.channel is not None and rid in r.channel.routes]
    return index


def idle(fake: FakeReplica) -> bool:
    e = fake.replica.engine
    return not e.has_unfinished() and e.kv.num_held_blocks() == 0


async def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_calls_stream_route_and_release(fakes):
    async def main():
        rs = make_set(fakes)
        q = await rs.submit([req("a-0"), req("a-1")], "t:alice")
        outs = await drain(q, ["a-0", "a-1"])
        assert {o.finish_reason for o in outs if o.finished} == {"length"}
        assert sum(len(o.new_token_ids) for o in outs) == 16
        await wait_for(lambda: all(r.inflight == 0 for r in rs._replicas))
        q = await rs.submit([req("b-0")], "t:alice")  # the same prompt: the same replica, from its cache
        q2 = await rs.submit([req("b-1", seed=3)], "t:alice")
        assert sum(len(f.replica._channels) for f in fakes) <= 2  # calls share their replica's one channel
        outs = await drain(q, ["b-0"])
        await drain(q2, ["b-1"])
        assert outs[-1].num_cached_tokens == 32
        await rs.refresh()
        assert rs.stats["prefix_cache_hits_tokens"] == 32  # the repeat (n=2 ran in one step: no hit yet)
    asyncio.run(main())


def test_a_replica_dying_mid_stream_fails_its_requests_cleanly_and_traffic_moves(fakes):
    async def main():
        rs = make_set(fakes)
        q = await rs.submit([req("long", max_tokens=400)], "t:alice")
        home = home_of(rs, "long")
        await asyncio.wait_for(q.get(), 30)  # it is running
        fakes[home].kill()
        outs = await drain(q, ["long"])
        last = outs[-1]
        assert last.finish_reason == "error" and isinstance(last.error, EngineUnavailable)
        assert f"replica {home}" in str(last.error)
        await wait_for(lambda: rs._replicas[home].inflight == 0)
        assert not rs._replicas[home].up and rs._replicas[home].failed_requests == 1
        q = await rs.submit([req("next", seed=0, max_tokens=200)], "t:alice")  # the same prefix: its replica is down
        assert home_of(rs, "next") == 1 - home
        await drain(q, ["next"])
        fakes[home].restart()
        await rs.refresh()
        assert rs._replicas[home].up and rs._replicas[home].restarts == 1
        await wait_for(lambda: idle(fakes[1 - home]))
    asyncio.run(main())


def test_a_replica_dead_before_admitting_is_retried_on_another(fakes):
    async def main():
        rs = make_set(fakes)
        rs.register_metrics(__import__("prometheus_client").CollectorRegistry())
        fakes[0].dead = True  # died, and no poll has noticed yet: the router still thinks it is up
        fakes[1].dead = False
        rs._replicas[1].inflight += 5  # busier: the router picks replica 0 first
        q = await rs.submit([req("r0", max_tokens=200)], "t:alice")
        assert fakes[0].num_calls == 1  # it was tried (its channel would not open) ...
        assert home_of(rs, "r0") == 1  # ... and failed, so replica 1 took it
        rs._replicas[1].inflight -= 5
        await drain(q, ["r0"])
        assert not rs._replicas[0].up
        for i in range(1, 4):  # and the next calls go to the survivor at once
            q = await rs.submit([req(f"r{i}", seed=i, max_tokens=200)], f"t:{i}")
            assert home_of(rs, f"r{i}") == 1
            await drain(q, [f"r{i}"])
        fakes[1].dead = True
        rs._replicas[1].up = True
        with pytest.raises(EngineUnavailable, match="no engine replica is up"):
            await rs.submit([req("x")], "t:alice")
        assert all(r.inflight == 0 for r in rs._replicas)
    asyncio.run(main())


def test_abort_frees_the_replicas_blocks(fakes):
    async def main():
        rs = make_set(fakes)
        q = await rs.submit([req("c-0", max_tokens=400), req("c-1", max_tokens=400)], "t:bob")
        home = fakes[home_of(rs, "c-0")]
        await asyncio.wait_for(q.get(), 30)
        rs.abort(["c-0", "c-1"])  # the client went away
        await wait_for(lambda: idle(home))
        await wait_for(lambda: all(r.inflight == 0 for r in rs._replicas))
        assert all(r.up and r.failed_requests == 0 for r in rs._replicas)
        q = await rs.submit([req("d-0", max_tokens=400), req("d-1", max_tokens=100)], "t:bob")
        await asyncio.wait_for(q.get(), 30)
        rs.abort(["d-0"])  # a part of a call: aborted on its replica, the rest goes on
        outs = await drain(q, ["d-1"])
        assert [o.finish_reason for o in outs if o.request_id == "d-1" and o.finished] == ["length"]
        await wait_for(lambda: idle(home))
    asyncio.run(main())


def test_a_refusal_comes_back_as_its_own_error(fakes):
    async def main():
        rs = make_set(fakes)
        with pytest.raises(PromptTooLongError):
            await rs.submit([req("big", n_prompt=5000)], "t:alice")
        assert all(r.inflight == 0 for r in rs._replicas)
    asyncio.run(main())


def test_a_replica_error_that_is_no_death_fails_the_call_but_keeps_the_replica(fakes):
    async def main():
        rs = make_set(fakes)
        fakes[0].fail_with = RuntimeError("a bug in the replica")  # not an actor death
        rs._replicas[1].inflight += 5  # the router picks replica 0
        with pytest.raises(EngineUnavailable, match="replica 0 failed this request"):
            await rs.submit([req("e0")], "t:alice")
        rs._replicas[1].inflight -= 5
        assert rs._replicas[0].up and all(r.inflight == 0 for r in rs._replicas)
        assert fakes[1].num_calls == 0  # not retried elsewhere: it may be the request's fault
    asyncio.run(main())


def test_shutdown_ends_every_call_still_reading(fakes):
    async def main():
        rs = make_set(fakes)
        q = await rs.submit([req("s-0", max_tokens=400)], "t:alice")
        home = fakes[home_of(rs, "s-0")]
        await asyncio.wait_for(q.get(), 30)
        rs.stop()
        outs = await drain(q, ["s-0"])
        assert outs[-1].finish_reason == "abort" and "shutting down" in str(outs[-1].error)
        await wait_for(lambda: idle(home))  # the cancelled channel aborted it on the replica
        assert all(r.inflight == 0 for r in rs._replicas)
    asyncio.run(main())


def test_a_replica_silent_past_the_admission_timeout_is_routed_around(fakes):
    async def main():
        rs = ReplicaSet(fakes, Router(2, RoutingConfig(block_size=16)), poll_s=0.05, death_errors=(ActorDied,),
                        admit_timeout_s=0.3)
        fakes[0].stalled = True
        rs._replicas[1].inflight += 5  # the router picks replica 0 first
        q = await rs.submit([req("t0", max_tokens=200)], "t:alice")
        rs._replicas[1].inflight -= 5
        assert home_of(rs, "t0") == 1 and not rs._replicas[0].up
        await drain(q, ["t0"])
        assert all(r.inflight == 0 for r in rs._replicas)
    asyncio.run(main())


def test_shutdown_is_bounded_when_the_teardown_hangs():
    import threading

    release = threading.Event()
    rs = ReplicaSet([object()], Router(1), on_shutdown=release.wait, death_errors=(ActorDied,))
    t0 = time.monotonic()
    assert rs.shutdown(timeout=0.2) is False  # the caller exits without Ray instead of waiting on it
    assert time.monotonic() - t0 < 2
    release.set()
    assert ReplicaSet([object()], Router(1), on_shutdown=lambda: None, death_errors=(ActorDied,)).shutdown() is True


def test_when_the_servers_own_ray_is_gone_it_says_so_and_promises_no_retry(fakes):
    """The raylet killed: every request got 503 'retry in a few seconds' for ever, and nothing was
    logged. Once every replica is down and the Ray instance is gone, the set says so, in /health's
    description and in the 503, once in the log."""
    gone = [False]

    async def main():
        rs = ReplicaSet(fakes, Router(2, RoutingConfig(block_size=16)), poll_s=0.05, death_errors=(ActorDied,),
                        cluster_gone=lambda: gone[0])
        rs.start()
        for f in fakes:
            f.kill()
        await wait_for(lambda: not any(r.up for r in rs._replicas))
        await asyncio.sleep(0.2)
        assert not rs.cluster_lost  # replicas down, Ray still there: they may come back
        with pytest.raises(EngineUnavailable, match="retry in a few seconds"):
            await rs.submit([req("a")], "t:alice")
        gone[0] = True
        await wait_for(lambda: rs.cluster_lost)
        with pytest.raises(EngineUnavailable, match="no engine replica can come back; restart isolab serve"):
            await rs.submit([req("b")], "t:alice")
        assert "restart isolab serve" in rs.describe()["error"]
        rs.stop()
    asyncio.run(main())
