"""Owns the race lab's benchmarks: QPS of every variant at the same thread count in one run (the
seed's "locked is ~10x slower" claim), the explorer's executions per second and its time to the
passcode race, the loopback service load, and (`explorer_only`) the explorer's cost on the
workloads before and after its reductions beside the real-thread figures its GIL model is checked
against. Prints a table; writes JSON."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from isolab.race import gil_stress
from isolab.race.checkers import FIXES, VARIANTS
from isolab.race.explorer import SwitchMode, bounded_search
from isolab.race.explorer.api import explore
from isolab.race.fixtures import SCENARIOS as FIXTURES
from isolab.race.scenarios import passcode
from isolab.race.service import loopback_load
from isolab.race.stress import StressConfig, environment, run_once
from isolab.race.workloads import SCENARIOS as WORKLOADS


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


# Measured at 1e2eacf (before issue 18) with the same workloads, `bounded(2)`, switch=opcode, on
# this machine: the explorer had no reduction beyond "locals are free". Kept as the "before" row.
BEFORE_ISSUE_18 = {
    "workloads:counter_3x3": {"executions": 16_158, "seconds": 24.19},
    "workloads:bounded_buffer": {"executions": 66_166, "seconds": 165.41},
    "passcode:buggy (count all)": {"executions": 266, "seconds": 2.17},
}


def explorer_cost(repeat: int = 3) -> dict[str, dict]:
    """Whole bounded(2) searches of the workloads: all reductions, and sleep sets off."""
    out: dict[str, dict] = {}
    for name in ("counter_3x3", "bounded_buffer"):
        row: dict[str, object] = {"before": BEFORE_ISSUE_18[f"workloads:{name}"]}
        for label, reduction in (("after", True), ("after, sleep sets off", False)):
            runs = []
            for _ in range(repeat if reduction else 1):
                result = bounded_search(WORKLOADS[name](), bound=2, mode=SwitchMode.OPCODE, reduction=reduction)
                assert result.failure is None and result.exhausted
                runs.append(result.seconds)
            row[label] = {"executions": result.executions, "seconds": round(statistics.median(runs), 2),
                          "seconds_runs": [round(r, 2) for r in runs]}
        before, after = row["before"], row["after"]
        assert isinstance(before, dict) and isinstance(after, dict)
        row["speedup"] = round(before["seconds"] / after["seconds"], 1)
        out[f"workloads:{name}"] = row
    times = []
    for _ in range(repeat):
        result = bounded_search(passcode("buggy"), bound=2, mode=SwitchMode.OPCODE, count_all=True)
        times.append(result.seconds)
    seconds = statistics.median(times)
    out["passcode:buggy (count all)"] = {
        "before": BEFORE_ISSUE_18["passcode:buggy (count all)"],
        "after": {"executions": result.executions, "seconds": round(seconds, 3),
                  "executions_per_second": round(result.executions / seconds, 1)},
    }
    return out


def gil_model_check(runs: int = 3_000) -> dict[str, object]:
    """The explorer's GIL verdicts beside what real threads do under CPython itself."""
    report = explore(FIXTURES["stock_oversell"](), SwitchMode.GIL, bound=2)
    finding = report.finding
    gadgets = {}
    for name, (gadget, claimed) in gil_stress.GADGETS.items():
        real = gil_stress.lost_updates(gadget, iterations=20_000, trials=3, stop_at_first=False)
        model = bounded_search(gil_stress.gadget_scenario(name), bound=2, mode=SwitchMode.GIL)
        gadgets[name] = {"model_switches": claimed, "explorer_gil_finds_loss": model.failure is not None,
                         "real_lost_updates_of_120000": real}
    return {
        "stock_oversell": {
            "explorer_gil": (f"FAILED: {finding.execution.message}; {report.search.executions} executions"
                             if finding else "holds"),
            f"real_threads_stock_2_of_{runs}_runs": gil_stress.oversells(runs, stock=2),
            f"real_threads_stock_1000_of_{runs}_runs": gil_stress.oversells(runs, stock=1000),
        },
        "two_lock_deadlock": {
            "explorer_gil": "holds" if bounded_search(FIXTURES["deadlock"](), 2, SwitchMode.GIL).failure is None
            else "FAILED",
            "real_threads_stuck_of_2000_runs_nothing_between": gil_stress.opposite_order_deadlocks(False, 2000, False),
            "real_threads_stuck_of_2000_runs_loop_between": gil_stress.opposite_order_deadlocks(True, 2000, False),
        },
        "gadgets": gadgets,
    }


def run_explorer_bench(json_path: Path | None = None) -> dict:
    cost = explorer_cost()
    gil = gil_model_check()
    print(f"{'explorer workload (bounded 2, opcode)':<40} {'before':>18} {'after':>18} {'sleep sets off':>18}")
    for name, row in cost.items():
        cells = [row.get(k) for k in ("before", "after", "after, sleep sets off")]
        text = [f"{c['executions']:,} / {c['seconds']}s" if c else "-" for c in cells]
        print(f"{name:<40} {text[0]:>18} {text[1]:>18} {text[2]:>18}")
    print()
    print("stock oversell:", gil["stock_oversell"])
    print("two-lock deadlock:", gil["two_lock_deadlock"])
    gadget_rows: dict[str, dict] = gil["gadgets"]  # type: ignore[assignment]
    for name, row in gadget_rows.items():
        print(f"  {name:<52} model switches: {row['model_switches']!s:<5} real lost updates: "
              f"{row['real_lost_updates_of_120000']}")
    payload = {"environment": environment(), "explorer_cost": cost, "gil_model": gil}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return payload


def run_bench(requests: int = 100_000, repeat: int = 3, threads: int = 8, json_path: Path | None = None) -> dict:
    print(f"QPS at {threads} threads, {requests:,} requests per run, {repeat} interleaved runs", file=sys.stderr)
    qps = qps_side_by_side(requests, repeat, threads)
    explorer = explorer_speed()
    # the service over loopback: a request over HTTP costs ~30 checks (bench/results/race.json), so it sends 8 % of
    # the requests, from as many clients as the QPS runs have threads
    service_requests = max(threads, requests * 8 // 100)
    service = {v: vars(loopback_load(v, clients=threads, requests=service_requests, switch_interval=1e-5))
               for v in ("buggy", "lock_local")}
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


# --- against frontrun (PyPI, optional: not a dependency; `pip install frontrun` into .venv) -----
def _frontrun_run(scenario_factory: Callable[[], Any], timeout: float) -> dict[str, object]:
    """One frontrun DPOR search (its defaults: preemption bound 2) of one of our scenarios: the
    workers store their results beside the state so our check(state, results) is the invariant."""
    import frontrun  # noqa: PLC0415  (optional)

    scenario = scenario_factory()
    n = len(scenario.threads)

    def setup() -> SimpleNamespace:
        return SimpleNamespace(inner=scenario.setup(), results=[None] * n)

    def worker(i: int) -> Callable[[SimpleNamespace], None]:
        def run(w: SimpleNamespace) -> None:
            w.results[i] = scenario.threads[i](w.inner)
        return run

    def invariant(w: SimpleNamespace) -> bool:
        return scenario.check(w.inner, tuple(w.results)) is None

    start = time.perf_counter()
    try:
        result = frontrun.explore(setup=setup, workers=[worker(i) for i in range(n)], invariant=invariant,
                                  total_timeout=timeout, deadlock_timeout=2.0, reproduce_on_failure=10)
    except Exception as exc:  # a deadlock or a crash in frontrun is a finding about frontrun
        return {"verdict": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                "seconds": round(time.perf_counter() - start, 2)}
    seconds = time.perf_counter() - start
    holds = result.property_holds
    return {
        "verdict": "holds" if holds else "FAILED" if holds is False else f"inconclusive ({result.inconclusive_reason})",
        "executions": result.num_explored,
        "seconds": round(seconds, 2),
        "replay": (f"{result.reproduction_successes} of {result.reproduction_attempts}"
                   if result.reproduction_attempts else "-"),
    }


def _ours(scenario_factory: Callable[[], Any], mode: SwitchMode, tmp: Path) -> dict[str, object]:
    from isolab.race.explorer.schedule import replay, save

    start = time.perf_counter()
    report = explore(scenario_factory(), mode, bound=2)
    seconds = time.perf_counter() - start
    row: dict[str, object] = {"verdict": report.verdict.value if report.finding is None else "FAILED",
                              "executions": report.search.executions, "seconds": round(seconds, 2)}
    if report.finding is not None:
        path = tmp / "schedule.txt"
        save(path, report.finding.schedule)
        from isolab.race.explorer.schedule import load as load_schedule

        again = replay(scenario_factory(), load_schedule(path), times=10)
        row["replay"] = f"{again.reproduced} of {again.runs}"
        row["label"] = "reachable with the GIL" if report.finding.gil_reachable else "free-threaded only"
    return row


def frontrun_comparison(json_path: Path | None = None, timeout: float = 120.0) -> dict:
    import tempfile

    import frontrun  # noqa: F401, PLC0415  (fails early with ImportError when not installed)

    targets: dict[str, Callable[[], Any]] = {
        "passcode:buggy": lambda: passcode("buggy"),
        "passcode:lock_local": lambda: passcode("lock_local"),
        **{f"fixtures:{n}": FIXTURES[n] for n in ("lost_update", "deadlock", "check_then_act", "lost_wakeup",
                                                  "stock_oversell", "stock_oversell_fixed")},
        **{f"workloads:{n}": WORKLOADS[n] for n in WORKLOADS},
        "frontrun README: Counter.increment x2": _frontrun_counter,
    }
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, factory in targets.items():
            row = {"isolab (opcode)": _ours(factory, SwitchMode.OPCODE, Path(tmp)),
                   "isolab (gil)": _ours(factory, SwitchMode.GIL, Path(tmp)),
                   "frontrun 0.7.0 (dpor)": _frontrun_run(factory, timeout)}
            out[name] = row
            print(name, json.dumps(row), flush=True)
    payload = {"environment": environment(), "frontrun": out}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return payload


class _FrontrunCounter:
    """frontrun's own README example: `self.value = self.value + 1` from two threads."""

    def __init__(self) -> None:
        self.value = 0

    def increment(self) -> None:
        temp = self.value
        self.value = temp + 1


def _frontrun_counter() -> Any:
    from isolab.race.explorer.scenario import Scenario

    return Scenario("frontrun:counter", _FrontrunCounter, (_FrontrunCounter.increment, _FrontrunCounter.increment),
                    lambda c, r: None if c.value == 2 else f"lost update: {c.value}")
