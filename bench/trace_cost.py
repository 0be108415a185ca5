"""What the lifecycle trace costs: the doctor's built-in workload (28 requests, shared prefixes and
repeats) run with and without `--trace`, alternating, a few repeats; the median ratio of CPU times, and the sink's own cost per event.

    python bench/trace_cost.py [--model PATH] [--repeats 5]   # default: the tiny random model on CPU

Writes bench/results/trace_cost.json. Run it alone: the ratio is only as good as a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from isolab.doctor.experiments import EngineTarget, drive
from isolab.doctor.workload import builtin_workload


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF (default: the tiny random model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trace_cost.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # one thread: CPU time then measures work, not spinning
    tmp = tempfile.mkdtemp(prefix="isolab-trace-")
    model = args.model
    if model is None:
        from isolab.testing.tiny_model import TinySpec, write_tiny_llama

        model = str(write_tiny_llama(f"{tmp}/tiny.gguf", TinySpec(layers=2, seed=1)))
    target = EngineTarget(dict(model=model, device=args.device, kv_cache_memory=1 << 20))
    items = target.prepare(builtin_workload())

    def once(trace: str | None) -> float:
        """CPU seconds of this process (wall time swings with other jobs on a shared machine)."""
        eng = target.new_engine(True, trace=trace)
        t = time.process_time()
        drive(eng, items, args.concurrency)
        eng.close()
        return time.process_time() - t

    def per_event_us(n: int = 20_000) -> float:
        """The sink alone: microseconds per emitted event."""
        from isolab.engine.events import JsonlSink

        sink = JsonlSink(f"{tmp}/bare.jsonl")
        t = time.perf_counter()
        for i in range(n):
            sink.emit("released", i % 97, "gen-12", None, refs=1)
        sink.close()
        return (time.perf_counter() - t) / n * 1e6

    once(None)  # warm up
    off, on = [], []
    trace = f"{tmp}/trace.jsonl"
    for i in range(args.repeats):
        for with_trace in ((False, True) if i % 2 == 0 else (True, False)):
            (on if with_trace else off).append(once(trace if with_trace else None))
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    size = os.path.getsize(trace)
    with open(trace) as fh:
        events = sum(1 for _ in fh)
    result = {
        "what": "CPU time of the doctor's built-in workload (28 requests, concurrency "
                f"{args.concurrency}) with the lifecycle trace on, over the same run with it off",
        "model": target.bundle.name, "device": args.device, "cpu": platform.processor() or platform.machine(),
        "clock": "process CPU time", "repeats": args.repeats, "cpu_seconds_off": off, "cpu_seconds_on": on,
        "median_ratio": statistics.median(ratios), "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "ratio_of_minimums": min(on) / min(off),
        "events_per_run": events, "trace_bytes_per_run": size, "sink_us_per_event": per_event_us(),
    }
    result["sink_share_of_run"] = result["sink_us_per_event"] * events / 1e6 / statistics.median(off)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"trace on / off: median ratio {result['median_ratio']:.3f}, of medians {result['ratio_of_medians']:.3f}, of minimums {result['ratio_of_minimums']:.3f} "
          f"({events} events, {size} bytes per run; the sink alone: {result['sink_us_per_event']:.1f} us an event, "
          f"{100 * result['sink_share_of_run']:.2f}% of a run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
