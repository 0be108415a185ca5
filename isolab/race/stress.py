"""Owns the load harness: many real threads hammer one shared checker and outcomes are counted.

It does not know how a checker works inside; it sees `check(candidate) -> bool` and grades the
four outcomes the way jcstress grades a test: right->accept and wrong->reject are ACCEPTABLE,
wrong->accept (false accept) and right->reject (false reject) are FORBIDDEN.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from isolab.errors import InvalidRequestError
from isolab.race.checkers import Variant

RIGHT = "open-sesame"  # lab constants; never printed by the harness
WRONG = "open-barley"
MAX_THREADS = 1024  # threads per run: far past where a race shows, well under a process's usual limits
MAX_SWITCH_INTERVAL = 10.0  # seconds: sys.setswitchinterval takes more, but a run would switch almost never


@dataclass(frozen=True)
class StressConfig:
    threads: int  # worker threads; each sends one passcode for the whole run
    requests: int  # total check() calls in the run, split evenly over the threads
    right_share: float = 0.5  # share of threads sending the right passcode (seed: half)
    switch_interval: float | None = None  # sys.setswitchinterval during the run; None = leave it

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidRequestError("threads must be at least 1", field="threads")
        if self.threads > MAX_THREADS:
            raise InvalidRequestError(f"threads must be at most {MAX_THREADS} (a race shows with a handful; "
                                      f"{self.threads} would exhaust the process's threads)", field="threads")
        if self.requests < self.threads:
            raise InvalidRequestError("requests must be at least the number of threads", field="requests")
        if not 0.0 <= self.right_share <= 1.0:
            raise InvalidRequestError("right share must be between 0 and 1", field="right_share")
        if self.switch_interval is not None and not 0 < self.switch_interval <= MAX_SWITCH_INTERVAL:
            # (NaN got through a `<= 0` check and killed the interpreter in take_gil; a huge value
            # became 0 in sys.setswitchinterval: the most switching, the opposite of what was asked)
            raise InvalidRequestError(f"switch interval must be a number of seconds in (0, {MAX_SWITCH_INTERVAL:g}], "
                                      f"not {self.switch_interval!r}", field="switch_interval")

    @property
    def num_right_threads(self) -> int:
        return round(self.threads * self.right_share)


@dataclass(frozen=True)
class RunResult:
    variant: str
    threads: int
    requests: int
    repeat: int  # 0-based index of this run among its repeats
    true_accepts: int  # right -> True
    true_rejects: int  # wrong -> False
    false_accepts: int  # wrong -> True  (FORBIDDEN)
    false_rejects: int  # right -> False (FORBIDDEN)
    seconds: float  # barrier release to last thread done
    switch_interval: float  # what sys.getswitchinterval() said during the run

    @property
    def qps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("inf")

    @property
    def false_accepts_per_100k(self) -> float:
        return self.false_accepts * 100_000 / self.requests

    def to_json(self) -> dict:
        return {**asdict(self), "qps": round(self.qps, 1)}


def run_once(variant: Variant, config: StressConfig, repeat: int = 0) -> RunResult:
    checker = variant.factory(RIGHT)
    per_thread = [config.requests // config.threads] * config.threads
    for i in range(config.requests % config.threads):
        per_thread[i] += 1
    counts = [[0, 0] for _ in range(config.threads)]  # [accepts, rejects] per thread
    barrier = threading.Barrier(config.threads + 1)

    def worker(index: int, candidate: str, n: int) -> None:
        accepts = 0
        check = checker.check
        try:
            barrier.wait()
        except threading.BrokenBarrierError:  # the run was called off before it began
            return
        for _ in range(n):
            if check(candidate):
                accepts += 1
        counts[index] = [accepts, n - accepts]

    workers = [
        threading.Thread(
            target=worker,
            args=(i, RIGHT if i < config.num_right_threads else WRONG, per_thread[i]),
            name=f"stress-{i}",
            # daemon: a Ctrl-C ends the command at once (it said "interrupted", then waited out every
            # worker's requests); a stop flag in the loop would change the timing the run measures
            daemon=True,
        )
        for i in range(config.threads)
    ]
    old_interval = sys.getswitchinterval()
    if config.switch_interval is not None:
        sys.setswitchinterval(config.switch_interval)
    started: list[threading.Thread] = []
    try:
        try:
            for w in workers:
                w.start()
                started.append(w)
            barrier.wait()
        except BaseException as exc:  # a thread the system will not start, or Ctrl-C: call the run off
            barrier.abort()  # the started workers leave at the barrier instead of waiting for the rest
            for w in started:
                w.join()
            if isinstance(exc, RuntimeError) and len(started) < config.threads:  # "can't start new thread"
                raise InvalidRequestError(f"could start only {len(started)} of {config.threads} threads ({exc}): "
                                          "ask for fewer --threads", field="threads") from None
            raise
        start = time.perf_counter()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        interval = sys.getswitchinterval()
    finally:
        sys.setswitchinterval(old_interval)
    right = counts[: config.num_right_threads]
    wrong = counts[config.num_right_threads :]
    return RunResult(
        variant=variant.name,
        threads=config.threads,
        requests=config.requests,
        repeat=repeat,
        true_accepts=sum(c[0] for c in right),
        false_rejects=sum(c[1] for c in right),
        false_accepts=sum(c[0] for c in wrong),
        true_rejects=sum(c[1] for c in wrong),
        seconds=seconds,
        switch_interval=interval,
    )


def sweep(
    variants: Sequence[Variant],
    thread_counts: Sequence[int],
    requests: int,
    repeat: int,
    right_share: float = 0.5,
    switch_interval: float | None = None,
    on_result=None,
) -> list[RunResult]:
    """Runs every (variant, threads) pair `repeat` times; repeats are the outer loop so that
    machine noise spreads over all variants instead of landing on one."""
    results: list[RunResult] = []
    for r in range(repeat):
        for threads in thread_counts:
            config = StressConfig(threads, requests, right_share, switch_interval)
            for variant in variants:
                result = run_once(variant, config, r)
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results


def grade(variant: Variant, result: RunResult) -> str:
    """jcstress-style verdict for one run."""
    forbidden = result.false_accepts + result.false_rejects
    if forbidden == 0:
        return "OK"
    return "FORBIDDEN seen (known race)" if variant.racy else "FAILED: FORBIDDEN seen"


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "gil": getattr(sys, "_is_gil_enabled", lambda: True)(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "default_switch_interval": sys.getswitchinterval(),
    }
