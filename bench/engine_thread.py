"""What an engine loses when it steps on another thread than the one that built it, and what
releasing the builder's OpenMP pool gives back (isolab/engine/omp_pool.py).

One process, one engine, one fixed job (32 prompts of 64-128 words, 48 new tokens each, greedy),
run in turn, round after round, three ways (alternating in one process cancels the machine's
drift, which moves separate runs by about 10 % here):
  main      on the thread that built the engine (`isolab bench`, `LLM.generate`);
  kept      on a second thread while the main thread's pool is alive (`isolab serve` before);
  released  on a second thread with no other pool alive (`EngineLoop.start` now).
Each run ends by releasing its own thread's pool, so it leaves the next as it found things.
Per mode: seconds per job (median), output tok/s, and the machine's idle share (/proc/stat).

    .venv/bin/python bench/engine_thread.py [--rounds 6]

Writes bench/results/engine_thread.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("main", "kept", "released")


def _cpu() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


class Worker:
    """A second thread that runs a job when asked (a server's engine thread, in miniature)."""

    def __init__(self, threads: int) -> None:
        self._go, self._done = threading.Event(), threading.Event()
        self._job: Callable[[], dict] | None = None
        self.result: dict = {}
        self._threads = threads
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        from isolab.engine.omp_pool import adopt_thread_count

        adopt_thread_count(self._threads)
        while True:
            self._go.wait()
            self._go.clear()
            assert self._job is not None
            self.result = self._job()
            self._done.set()

    def run(self, job: Callable[[], dict]) -> dict:
        self._job = job
        self._done.clear()
        self._go.set()
        self._done.wait()
        return self.result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default="bench/results/engine_thread.json")
    args = ap.parse_args()
    import torch

    from isolab.bench.workload import WorkloadSpec, make_workload
    from isolab.engine.omp_pool import release_thread_pool
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    llm = LLM()
    wl = make_workload(WorkloadSpec(32, (64, 128), (48, 48), 0, 0.0, 0))
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = 32 * 48

    def job() -> dict:
        a, t = _cpu(), time.perf_counter()
        llm.generate(wl.prompts, sp)
        s = time.perf_counter() - t
        d = [y - x for x, y in zip(a, _cpu(), strict=True)]
        release_thread_pool()  # leave no pool behind: the next mode sets up its own case
        return {"s": s, "tok_s": tokens / s, "idle_pct": 100 * d[3] / sum(d)}

    worker = Worker(torch.get_num_threads())

    def kept() -> dict:
        torch.randn(1 << 21).exp_()  # a parallel region on the main thread: its pool is alive again
        r = worker.run(job)
        release_thread_pool()  # and gone before the next mode
        return r

    run = {"main": job, "kept": kept, "released": lambda: worker.run(job)}
    job(), worker.run(job)  # warm both threads
    runs = []
    for rnd in range(args.rounds):
        for mode in MODES:
            r = run[mode]() | {"mode": mode, "round": rnd}
            runs.append(r)
            print(f"round {rnd}  {mode:9s} {r['s']:6.3f} s  {r['tok_s']:6.1f} tok/s  idle {r['idle_pct']:4.1f} %",
                  flush=True)
    med = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m) for k in ("s", "tok_s", "idle_pct")}
           for m in MODES}
    out = {"job": {"prompts": 32, "prompt_words": [64, 128], "new_tokens": 48}, "threads": torch.get_num_threads(),
           "runs": runs, "median": med,
           "kept_over_main": med["main"]["s"] / med["kept"]["s"],
           "released_over_main": med["main"]["s"] / med["released"]["s"]}
    print("median tok/s: " + "  ".join(f"{m} {v['tok_s']:.1f}" for m, v in med.items())
          + f"  |  kept/main {out['kept_over_main']:.3f}  released/main {out['released_over_main']:.3f}"
          + "  |  idle: " + "  ".join(f"{m} {v['idle_pct']:.1f} %" for m, v in med.items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
