"""What another busy thread on the cores costs a decode step (the tax a served engine pays for its
server's event loop, the HTTP client and the hypervisor), and what the quantized GEMM's task
sharing (isolab/kernels/balance.h) gives back.

The kernels fork and join an OpenMP team for every op (about 240 a step). When another thread
takes a core, the team waits at the op's end for the thread that lost it, so the step can lose more
than the CPU the other thread took, most with many short wakeups (an HTTP server's clients).
With task sharing, the GEMM's thread that keeps its core takes the panels the other has not
started; the join still waits for the task the other was in.

One engine decodes N rows (`bench/step_profile.py`'s set-up); a second process burns `busy` ms of
every `period` ms on the cores. `--switch load` (default): the load on and off from one step to
the next (a, l, l, a, ...), task sharing on, so the machine's drift falls on both sides alike;
per load: the median step alone and loaded, the median of the paired differences, and the share
of the machine the load took (busy / period / 2 of a 2-core step). `--switch sharing`: the load
always on, the GEMM's task sharing off and on from one step to the next; per load: the median of
the paired savings (static minus shared).

    .venv/bin/python bench/interference.py [--concurrency 128] [--steps 60] [--loads 1/10,3/10]
        [--switch load|sharing]

Writes bench/results/interference.json (interference_sharing.json with --switch sharing). Run it
alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import decoding_engine  # noqa: E402

from isolab.models.bundle import load_bundle  # noqa: E402


def burn(busy_s: float, period_s: float, stop, active) -> None:  # the other busy thread, in its own process
    while not stop.is_set():
        active.wait(0.1)
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(period_s - busy_s)


def paired(bundle, dtype: str, n: int, words: tuple[int, int], steps: int, load: tuple[float, float],
           switch: str) -> dict:
    from isolab import kernels

    engine, _ = decoding_engine(bundle, dtype, n, words, 2 * steps + 64)
    stop, active = mp.Event(), mp.Event()
    burner = mp.Process(target=burn, args=(load[0] / 1e3, load[1] / 1e3, stop, active), daemon=True)
    sides = ("alone", "loaded") if switch == "load" else ("static", "shared")
    ms: dict[str, list[float]] = {k: [] for k in sides}
    try:
        burner.start()
        if switch == "sharing" and load[0] > 0:
            active.set()
        for i in range(2 * steps):
            side = sides[(i + i // 2) % 2]  # a, b, b, a, a, b, ...: neither side always goes first
            if switch == "load":
                (active.set if side == "loaded" else active.clear)()
                time.sleep(0.002)
            else:
                kernels.balance(side == "shared")
            t0 = time.perf_counter()
            engine.step()
            ms[side].append((time.perf_counter() - t0) * 1e3)
    finally:
        kernels.balance(True)
        stop.set()
        active.set()
        burner.join()
        engine.close()
    diff = [b - a for a, b in zip(ms[sides[0]], ms[sides[1]], strict=True)]
    out = {"concurrency": n, "load_busy_ms": load[0], "load_period_ms": load[1], "steps_each": steps, "switch": switch,
           "median_step_ms": {k: statistics.median(v) for k, v in ms.items()}, "step_ms": ms}
    if switch == "load":
        out["median_paired_cost_ms"] = statistics.median(diff)
        out["fair_cost_ms"] = out["median_step_ms"]["alone"] * load[0] / load[1] / 2  # the CPU the load took
    else:
        out["median_paired_saving_ms"] = -statistics.median(diff)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="128")
    ap.add_argument("--prompt-len", default="64:256", help="prompt words, LO:HI")
    ap.add_argument("--steps", type=int, default=60, help="steps each way, per load")
    ap.add_argument("--loads", default="1/10,3/10", help="busy/period ms of the other process (0: none)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--switch", choices=("load", "sharing"), default="load",
                    help="what changes from one step to the next")
    ap.add_argument("--json")
    args = ap.parse_args()
    from isolab import kernels

    if args.switch == "sharing" and not kernels.balance(True):
        print("interference: --switch sharing needs the native kernels (the task sharing is theirs)", file=sys.stderr)
        return 2
    lo, _, hi = args.prompt_len.partition(":")
    words = (int(lo), int(hi or lo))
    loads = [(0.0, 1.0) if x == "0" else tuple(float(v) for v in x.split("/")) for x in args.loads.split(",")]
    bundle = load_bundle(None, dtype=args.dtype, weights="native")
    rows = []
    for n in (int(c) for c in args.concurrency.split(",")):
        for load in loads:
            r = paired(bundle, args.dtype, n, words, args.steps, load, args.switch)  # type: ignore[arg-type]
            m = r["median_step_ms"]
            if args.switch == "load":
                print(f"N={n} load {load[0]:g}/{load[1]:g} ms: alone {m['alone']:.1f} ms, loaded {m['loaded']:.1f} ms, "
                      f"paired cost {r['median_paired_cost_ms']:.1f} ms (the CPU it took: {r['fair_cost_ms']:.1f} ms)",
                      flush=True)
            else:
                print(f"N={n} load {load[0]:g}/{load[1]:g} ms: static {m['static']:.1f} ms, shared {m['shared']:.1f} ms, "
                      f"paired saving {r['median_paired_saving_ms']:.2f} ms", flush=True)
            rows.append(r)
    out = {"bench": "interference", "cpu": kernels.isa_level(), "qgemm": kernels.qgemm_isa(), "rows": rows}
    name = "interference.json" if args.switch == "load" else "interference_sharing.json"
    path = Path(args.json or Path(__file__).parent / "results" / name)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
