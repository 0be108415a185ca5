"""Owns the race lab's benchmarks: QPS of every variant at the same thread count in one run (the
seed's "locked is ~10x slower" claim), the explorer's executions per second and its time to the
passcode race, and the loopback service load. Prints a table; writes JSON."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from isolab.race.checkers import FIXES, VARIANTS
from isolab.race.explorer import SwitchMode, bounded_search
from isolab.race.scenarios import passcode
from isolab.race.service import loopback_load
from isolab.race.stress import StressConfig, environment, run_once


def qps_side_by_side(requests: int, repeat: int, threads: int) -> dict[str, dict]:
    names = ["buggy", *FIXES]
    config = StressConfig(threads, requests)
    samples: dict[str, list[float]] = {n: [] for n in names}
    false_accepts: dict[str, list[int]] = {n: [] for n in names}
    for _ in range(repeat):  # interleaved, so drift in machine load hits every variant alike
        for name in names:
            r = run_once(VARIANTS[name], config)
            samples[name].append(r.qps)
            false_accepts[name].append(r.false_accepts)
    base = statistics.median(samples["buggy"])
    return {
        n: {
            "qps_median": round(statistics.median(samples[n]), 1),
            "qps_runs": [round(q, 1) for q in samples[n]],
            "slowdown_vs_buggy": round(base / statistics.median(samples[n]), 2),
            "false_accepts": false_accepts[n],
        }
        for n in names
    }


def explorer_speed() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, mode in (("buggy", SwitchMode.GIL), ("buggy", SwitchMode.OPCODE),
                       ("lock_local", SwitchMode.OPCODE), ("thread_local", SwitchMode.OPCODE)):
        start = time.perf_counter()
        result = bounded_search(passcode(name), bound=2, mode=mode)
        seconds = time.perf_counter() - start
        out[f"passcode:{name}/{mode.value}"] = {
            "verdict": f"FAILED: {result.failure.message}" if result.failure else "holds within 2 preemptions",
            "executions": result.executions,
            "seconds": round(seconds, 3),
            "executions_per_second": round(result.executions / seconds, 1),
        }
    return out


def run_bench(requests: int = 100_000, repeat: int = 3, threads: int = 8, json_path: Path | None = None) -> dict:
    print(f"QPS at {threads} threads, {requests:,} requests per run, {repeat} interleaved runs", file=sys.stderr)
    qps = qps_side_by_side(requests, repeat, threads)
    explorer = explorer_speed()
    service = {v: vars(loopback_load(v, clients=8, requests=8000, switch_interval=1e-5)) for v in ("buggy", "lock_local")}
    print(f"{'variant':<14} {'QPS (median)':>13} {'x slower':>9}  runs / false accepts")
    for name, row in qps.items():
        print(f"{name:<14} {row['qps_median']:>13,.0f} {row['slowdown_vs_buggy']:>9.2f}  "
              f"{', '.join(f'{q:,.0f}' for q in row['qps_runs'])} / {row['false_accepts']}")
    print()
    print(f"{'explorer target':<30} {'executions':>10} {'seconds':>8} {'exec/s':>8}  verdict")
    for name, row in explorer.items():
        print(f"{name:<30} {row['executions']:>10} {row['seconds']:>8.3f} {row['executions_per_second']:>8.0f}  {row['verdict']}")
    print()
    for name, row in service.items():
        print(f"service {name:<11} {row['requests']} requests over loopback (switch interval 10 us): "
              f"{row['false_accepts']} false accepts, {row['false_rejects']} false rejects, "
              f"{row['requests'] / row['seconds']:,.0f} req/s")
    payload = {"environment": environment(), "threads": threads, "requests": requests, "repeat": repeat,
               "qps": qps, "explorer": explorer, "service": service}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return payload
