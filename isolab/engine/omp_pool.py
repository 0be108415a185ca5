"""Owns the OpenMP worker pools of the process: which thread may hold one while an engine steps.

libgomp (torch's OpenMP, which isolab's kernels share) gives every thread that opens a parallel
region a pool of its own workers, and it stops spinning at barriers once it manages more threads
than the process has CPUs: its spin count drops from 300,000 to 100, so every barrier of every
kernel sleeps in a futex and wakes again. A server builds its engine on one thread (loading the
model and the start-up invariance check run kernels there, so that thread gets a pool) and steps
it on another (a second pool). On 2 CPUs that is 4 managed threads for 2 cores: the engine's
threads slept through 13 % of a 32-concurrent run and decoded 440 tok/s against 527 from the
thread that built it (`bench/engine_thread.py`, `docs/engine.md`).

A second fact: a new thread's OpenMP team size starts at the CPU count, whatever
`torch.set_num_threads` said on another thread (torch sets it on a thread lazily, at that thread's
first parallel op), so kernels called first on an engine thread could run on every core of a
replica given one. `adopt_thread_count(n)` sets it on the calling thread.

Invariant: while an engine steps on its own thread, no other thread of the process holds an
OpenMP pool, and the engine thread's team size is the builder's. `release_thread_pool()` frees the calling thread's pool (OpenMP 5.0's
`omp_pause_resource_all(omp_pause_soft)`; its workers exit and a later parallel region on that
thread makes a new pool); `EngineLoop.start` calls it on the thread that built the engine, before
the engine thread runs. It changes which threads exist, never what a kernel computes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the pool's threads, keep the runtime


@functools.lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp, libiomp5 or libomp) with OpenMP 5.0's pause API."""
    import torch  # noqa: F401  (loads the runtime)

    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    names = ("libgomp", "libiomp", "libomp")
    for path in sorted({ln.split()[-1] for ln in maps.read_text().splitlines()
                        if ln.split()[-1].rsplit("/", 1)[-1].startswith(names)}):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.restype, lib.omp_pause_resource_all.argtypes = ctypes.c_int, [ctypes.c_int]
            lib.omp_get_max_threads.restype, lib.omp_get_max_threads.argtypes = ctypes.c_int, []
        except (OSError, AttributeError):
            continue
        return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; False where the runtime has none to free or
    no pause API (nothing else changes)."""
    lib = _runtime()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0


def adopt_thread_count(threads: int) -> None:
    """Give the calling thread's OpenMP teams `threads` threads (torch's count, set on this thread)."""
    import torch

    torch.set_num_threads(threads)


def team_size() -> int:
    """The calling thread's OpenMP team size (omp_get_max_threads); torch's count without a runtime."""
    lib = _runtime()
    if lib is None:
        import torch

        return torch.get_num_threads()
    return int(lib.omp_get_max_threads())
