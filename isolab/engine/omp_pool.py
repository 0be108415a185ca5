"""Owns the OpenMP worker pools of the process: which thread may hold one while an engine steps.

libgomp (torch's OpenMP, which isolab's kernels share) gives every thread that opens a parallel
region a pool of its own workers, and it stops spinning at barriers once it manages more threads
than the process has CPUs: its spin count drops from 300,000 to 100, so every barrier of every
kernel sleeps in a futex and wakes again. A server builds its engine on one thread (loading the
model and the start-up invariance check run kernels there, so that thread gets a pool) and steps
it on another (a second pool): more managed threads than cores. `bench/engine_thread.py` measures
it (docs/engine.md, "The server's engine thread and OpenMP's pools").

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


def gomp_paths(maps: str) -> list[str]:
    """The libgomp files mapped into a process, from its /proc/PID/maps text (anonymous mappings,
    "(deleted)" suffixes and paths with spaces allowed)."""
    found: set[str] = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].removesuffix(" (deleted)")
        if path.rsplit("/", 1)[-1].startswith("libgomp"):
            found.add(path)
    return sorted(found)


@functools.lru_cache(maxsize=1)
def _runtimes() -> tuple[ctypes.CDLL, ...]:
    """Every libgomp loaded (torch's, and the system's if the kernels pulled in a second copy).
    Only libgomp: its omp_pause_resource_all frees the calling thread's pool, where LLVM's libomp
    and Intel's libiomp5 pause the whole program's threads, which is not what is wanted here."""
    import torch  # noqa: F401  (loads the runtime)

    maps = Path("/proc/self/maps")
    libs = []
    for path in gomp_paths(maps.read_text()) if maps.exists() else []:
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.restype, lib.omp_pause_resource_all.argtypes = ctypes.c_int, [ctypes.c_int]
            lib.omp_get_max_threads.restype, lib.omp_get_max_threads.argtypes = ctypes.c_int, []
            lib.omp_set_num_threads.restype, lib.omp_set_num_threads.argtypes = None, [ctypes.c_int]
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    return tuple(libs)


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; False where no libgomp with the pause API is
    loaded (then nothing changes). Inside a parallel region libgomp refuses (returns non-zero)."""
    libs = _runtimes()
    ok = bool(libs)
    for lib in libs:
        rc = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
        if rc != 0:
            log.debug("omp_pause_resource_all returned %d", rc)
            ok = False
    return ok


def adopt_thread_count(threads: int) -> None:
    """Give the calling thread's OpenMP teams `threads` threads, in torch and in every libgomp."""
    import torch

    torch.set_num_threads(threads)
    for lib in _runtimes():
        lib.omp_set_num_threads(threads)


def team_size() -> int:
    """The calling thread's OpenMP team size (omp_get_max_threads); torch's count without libgomp."""
    libs = _runtimes()
    if not libs:
        import torch

        return torch.get_num_threads()
    return int(libs[0].omp_get_max_threads())
