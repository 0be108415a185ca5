"""What another busy thread on the cores costs a decode step: the tax a served engine pays for
its server's event loop, the HTTP client and the hypervisor.

The kernels fork and join an OpenMP team for every op (about 240 a step). When another thread
takes a core, the team waits at the op's end for the thread that lost it, so the step can lose more
than the CPU the other thread took. Task sharing inside a kernel does not help (tried: qgemm's panels
shared out by atomic counters, no change under load): the join still waits for every thread.

One engine decodes N rows (`bench/step_profile.py`'s set-up); a second process burns `busy` ms of
every `period` ms on the cores, switched on and off from one step to the next (a, l, l, a, ...), so
the machine's drift falls on both sides alike. Per load: the median step alone and loaded, and the
median of the paired differences, against the share of the machine the load took (busy / period / 2
of a 2-core step).

    .venv/bin/python bench/interference.py [--concurrency 128] [--steps 60] [--loads 1/10,3/10]

Writes bench/results/interference.json. Run it alone (2 cores).
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


def paired(bundle, dtype: str, n: int, words: tuple[int, int], steps: int, load: tuple[float, float]) -> dict:
    engine, _ = decoding_engine(bundle, dtype, n, words, 2 * steps + 64)
    stop, active = mp.Event(), mp.Event()
    burner = mp.Process(target=burn, args=(load[0] / 1e3, load[1] / 1e3, stop, active), daemon=True)
    ms: dict[str, list[float]] = {"alone": [], "loaded": []}
    try:
        burner.start()
        for i in range(2 * steps):
            mode = ("alone", "loaded")[(i + i // 2) % 2]  # a, l, l, a, a, l, ...: neither side always goes first
            (active.set if mode == "loaded" else active.clear)()
            time.sleep(0.002)
            t0 = time.perf_counter()
            engine.step()
            ms[mode].append((time.perf_counter() - t0) * 1e3)
    finally:
        stop.set()
        active.set()
        burner.join()
        engine.close()
    diff = [b - a for a, b in zip(ms["alone"], ms["loaded"], strict=True)]
    return {"concurrency": n, "load_busy_ms": load[0], "load_period_ms": load[1], "steps_each": steps,
            "median_step_ms": {k: statistics.median(v) for k, v in ms.items()},
            "median_paired_cost_ms": statistics.median(diff), "step_ms": ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="128")
    ap.add_argument("--prompt-len", default="64:256", help="prompt words, LO:HI")
    ap.add_argument("--steps", type=int, default=60, help="steps each way, per load")
    ap.add_argument("--loads", default="1/10,3/10", help="busy/period ms of the other process (0: none)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "interference.json"))
    args = ap.parse_args()
    lo, _, hi = args.prompt_len.partition(":")
    words = (int(lo), int(hi or lo))
    loads = [tuple(float(v) for v in x.split("/")) for x in args.loads.split(",")]
    bundle = load_bundle(None, dtype=args.dtype, weights="native")
    rows = []
    for n in (int(c) for c in args.concurrency.split(",")):
        for load in loads:
            r = paired(bundle, args.dtype, n, words, args.steps, load)  # type: ignore[arg-type]
            m = r["median_step_ms"]
            fair = m["alone"] * load[0] / load[1] / 2  # the step's share of the CPU the load took
            r["fair_cost_ms"] = fair
            print(f"N={n} load {load[0]:g}/{load[1]:g} ms: alone {m['alone']:.1f} ms, loaded {m['loaded']:.1f} ms, "
                  f"paired cost {r['median_paired_cost_ms']:.1f} ms (the CPU it took: {fair:.1f} ms)", flush=True)
            rows.append(r)
    from isolab import kernels

    out = {"bench": "interference", "cpu": kernels.isa_level(), "qgemm": kernels.qgemm_isa(), "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
