"""What an engine loses when it steps on another thread than the one that built it, and what
releasing the builder's OpenMP pool gives back (isolab/engine/omp_pool.py).

Three ways to drive the same engine bench (2*C requests, prompts of 64-256 words, 128 new tokens,
greedy), each in a fresh process, in turn, for --rounds rounds:
  main      the thread that built the engine steps it (`isolab bench`, `LLM.generate`);
  thread    a second thread steps it and the builder's pool stays (what `isolab serve` did);
  released  a second thread steps it after release_thread_pool() on the builder (`EngineLoop.start`).
Per run: output tok/s, ITL p50 and the machine's idle share over the run (/proc/stat).

    .venv/bin/python bench/engine_thread.py [--concurrency 32] [--rounds 2]

Writes bench/results/engine_thread.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

MODES = ("main", "thread", "released")


def _cpu() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


def child(mode: str, concurrency: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from isolab.bench.engine_bench import run_engine_bench
    from isolab.bench.workload import WorkloadSpec, make_workload
    from isolab.engine.omp_pool import release_thread_pool
    from isolab.llm import LLM

    llm = LLM()  # built on this (the main) thread: the load and the start-up check leave it a pool
    wl = make_workload(WorkloadSpec(2 * concurrency, (64, 256), (128, 128), 0, 0.0, 0))
    out: dict = {"mode": mode}

    def run() -> None:
        a = _cpu()
        r = run_engine_bench(llm.engine, wl, concurrency)
        d = [y - x for x, y in zip(a, _cpu(), strict=True)]
        out.update(tok_s=round(r["output_tokens_per_s"], 1), itl_p50_ms=round(r["itl_s"]["p50"] * 1e3, 1),
                   idle_pct=round(100 * d[3] / sum(d), 1))

    if mode == "main":
        run()
    else:
        if mode == "released":
            release_thread_pool()
        t = threading.Thread(target=run)
        t.start()
        t.join()
    return out


def summary(runs: list[dict]) -> dict:
    """Medians per mode: tok/s moves by about 10 % from run to run here; the idle share does not."""
    return {key: {m: statistics.median(r[field] for r in runs if r["mode"] == m) for m in MODES}
            for key, field in (("median_tok_s", "tok_s"), ("median_itl_p50_ms", "itl_p50_ms"),
                               ("median_idle_pct", "idle_pct"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench/results/engine_thread.json")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.concurrency)))
        return 0
    runs = []
    for rnd in range(args.rounds):
        for mode in MODES:
            res = subprocess.run([sys.executable, __file__, "--child", mode, "--concurrency", str(args.concurrency)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1]) | {"round": rnd}
            runs.append(r)
            print(f"round {rnd}  {mode:9s} {r['tok_s']:7.1f} tok/s  ITL p50 {r['itl_p50_ms']:5.1f} ms  "
                  f"idle {r['idle_pct']:4.1f} %", flush=True)
    out = {"concurrency": args.concurrency, "runs": runs} | summary(runs)
    print("median: " + "  ".join(f"{m} {v:.1f} tok/s" for m, v in out["median_tok_s"].items())
          + "  |  idle: " + "  ".join(f"{m} {v:.1f} %" for m, v in out["median_idle_pct"].items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
