"""The OpenMP pool rule (engine/omp_pool.py): an engine that steps on its own thread runs with no
other thread's pool alive, because libgomp stops spinning at barriers once it manages more threads
than there are CPUs. The cost shows in `bench/engine_thread.py`; these tests hold the mechanism."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from isolab.engine import omp_pool
from isolab.server import engine_loop
from isolab.server.engine_loop import EngineLoop
from isolab.testing.workload import make_engine


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _settle(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_release_frees_the_calling_threads_workers_and_a_later_region_makes_new_ones():
    """By thread ids, so threads that other tests leave behind or end meanwhile change nothing."""
    if torch.get_num_threads() < 2:
        pytest.skip("one OpenMP thread: no workers to free")
    seen: dict[str, object] = {}

    def run() -> None:
        x = torch.randn(1 << 21)
        before = _tids()
        x.exp_()  # a parallel region on this thread: a pool of get_num_threads() - 1 workers
        workers = _tids() - before
        seen["workers"] = len(workers)
        seen["released"] = omp_pool.release_thread_pool()
        seen["freed"] = _settle(lambda: not (workers & _tids()))
        before = _tids()
        x.exp_()
        seen["made_again"] = len(_tids() - before)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["workers"] >= torch.get_num_threads() - 1, seen
    assert seen["released"] is True and seen["freed"] is True, seen
    assert seen["made_again"] >= torch.get_num_threads() - 1, seen  # the next region made its pool again


def test_engine_loop_releases_the_builders_pool_before_its_thread_runs(tiny_bundle, monkeypatch):
    engine = make_engine(tiny_bundle, 64)
    calls: list[tuple[int, bool]] = []
    loop = EngineLoop(engine)
    real = omp_pool.release_thread_pool

    def spy() -> bool:
        calls.append((threading.get_ident(), loop._thread.ident is None))
        return real()

    monkeypatch.setattr(engine_loop, "release_thread_pool", spy)
    loop.start()
    loop.start()  # the lifespan's second call changes nothing
    try:
        assert calls == [(threading.get_ident(), True)]  # on the builder's thread, before the engine's ran
    finally:
        loop.stop()


def test_release_without_a_pause_api_is_a_no_op(monkeypatch):
    monkeypatch.setattr(omp_pool, "_runtimes", lambda: ())
    assert omp_pool.release_thread_pool() is False


def test_the_engine_thread_takes_the_builders_thread_count(tiny_bundle):
    """A new thread's OpenMP teams start at the CPU count; a replica given 1 thread must not use 2."""
    if os.cpu_count() == 1:
        pytest.skip("one CPU: every count is 1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(tiny_bundle, 64)
        loop = EngineLoop(engine)
        loop.start()
        try:
            assert _settle(lambda: loop.team_size != 0)
            assert loop.team_size == 1
        finally:
            loop.stop()
    finally:
        torch.set_num_threads(before)


def test_gomp_paths_reads_maps_lines_of_every_shape():
    maps = "\n".join([
        "7f00-7f01 r-xp 00000000 08:01 123  /opt/torch/lib/libgomp.so.1",
        "7f01-7f02 rw-p 00000000 00:00 0 ",
        "7f02-7f03 rw-p 00000000 00:00 0  [heap]",
        "7f03-7f04 r-xp 00000000 08:01 124  /usr/lib/x86_64-linux-gnu/libgomp.so.1 (deleted)",
        "7f04-7f05 r-xp 00000000 08:01 125  /home/a user/env/lib/libgomp-a34b3233.so.1",
        "7f05-7f06 r-xp 00000000 08:01 126  /usr/lib/libomp.so.5",
        "7f06-7f07 r-xp 00000000 08:01 123  /opt/torch/lib/libgomp.so.1",
    ])
    assert omp_pool.gomp_paths(maps) == ["/home/a user/env/lib/libgomp-a34b3233.so.1", "/opt/torch/lib/libgomp.so.1",
                                         "/usr/lib/x86_64-linux-gnu/libgomp.so.1"]
