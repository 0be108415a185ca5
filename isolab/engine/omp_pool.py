"""Owns the OpenMP worker pools of the process: which thread may hold one while an engine steps.

libgomp (torch's OpenMP, which isolab's kernels share) gives every thread that opens a parallel
region a pool of its own workers, and it stops spinning at barriers once it manages more threads
than the process has CPUs: its spin count drops from 300,000 to 100, so every barrier of every
kernel sleeps in a futex and wakes again. A server builds its engine on one thread (loading the
model and the start-up invariance check run kernels there, so that thread gets a pool) and steps
it on another (a second pool). On 2 CPUs that is 4 managed threads for 2 cores: the engine's
threads slept through 13 % of a 32-concurrent run and decoded 440 tok/s against 527 from the
thread that built it (`bench/engine_thread.py`, `docs/engine.md`).

Invariant: while an engine steps on its own thread, no other thread of the process holds an
OpenMP pool. `release_thread_pool()` frees the calling thread's pool (OpenMP 5.0's
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
def _pause_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """omp_pause_resource_all of the OpenMP runtime torch loaded (libgomp, libiomp5 or libomp)."""
    import torch  # noqa: F401  (loads the runtime)

    runtimes = sorted({ln.split()[-1] for ln in Path("/proc/self/maps").read_text().splitlines()
                       if ln.split()[-1].rsplit("/", 1)[-1].startswith(("libgomp", "libiomp", "libomp"))}) \
        if Path("/proc/self/maps").exists() else []
    for path in runtimes:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        return fn
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; False where the runtime has none to free or
    no pause API (nothing else changes)."""
    fn = _pause_fn()
    if fn is None:
        return False
    rc = fn(OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0
