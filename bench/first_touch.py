"""What a fresh engine pays to touch its KV pool for the first time: the pool in 4 KiB pages (now)
against 2 MiB transparent huge pages (numpy's zeros, which asked for them, before).

A layer's pool is 2 x Hkv runs of num_blocks blocks (kv_storage.py), and a batch's first blocks
land in every run, so each huge page the OS zeroes on first touch holds 2 KiB that anybody wrote.
Each round runs each way in a fresh process (a warm process has its pages already): a fresh
engine, 32 requests of 16-64-word prompts, 128 new tokens each, greedy, stepped to the end
(issue 13's 32-concurrent workload). Per way: output tok/s, the first three steps (prefill
chunks), the decode steps' median and p90, the pool's huge pages and the peak RSS.

    .venv/bin/python bench/first_touch.py [--rounds 3]

Writes bench/results/first_touch.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("4k", "huge")


def _anon_huge_kib() -> int:
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def job(mode: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from isolab.bench.workload import WorkloadSpec, make_workload
    from isolab.config import build_engine_config
    from isolab.engine import kv_storage
    from isolab.engine.llm_engine import LLMEngine
    from isolab.models.bundle import load_bundle
    from isolab.sampling_params import SamplingParams

    if mode == "huge":  # the pool as it was: numpy's zeros, which madvise(MADV_HUGEPAGE) large arrays
        def numpy_zeros(shape, dtype, device):
            nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)

        kv_storage._zeros = numpy_zeros
    bundle = load_bundle(None, dtype="bf16", weights="native")
    engine = LLMEngine(build_engine_config(dtype="bf16", weights=bundle.weights), bundle)
    huge_before = _anon_huge_kib()
    wl = make_workload(WorkloadSpec(num_requests=32, prompt_len=(16, 64), output_len=(128, 128), seed=0))
    for i, p in enumerate(wl.prompts):
        engine.add_request(f"r{i}", engine.tokenizer.encode(p),
                           SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    steps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    wall = time.perf_counter() - t0
    decode = sorted(steps[3:])
    out = {"mode": mode, "tok_s": 32 * 128 / wall, "wall_s": wall, "first_steps_ms": steps[:3],
           "decode_p50_ms": decode[len(decode) // 2], "decode_p90_ms": decode[int(len(decode) * 0.9)],
           "huge_pages_mib": (_anon_huge_kib() - huge_before) / 1024,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "first_touch.json"))
    ap.add_argument("--job", choices=MODES, help=argparse.SUPPRESS)  # one way, in this (fresh) process
    args = ap.parse_args()
    if args.job:
        print(json.dumps(job(args.job)))
        return 0
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            res = subprocess.run([sys.executable, __file__, "--job", mode], capture_output=True, text=True, check=True)
            run = json.loads(res.stdout.strip().splitlines()[-1])
            runs[mode].append(run)
            print(f"round {r + 1} {mode:>4}: {run['tok_s']:.1f} tok/s, first steps "
                  f"{', '.join(f'{x:.0f}' for x in run['first_steps_ms'])} ms, decode p50 {run['decode_p50_ms']:.1f} "
                  f"p90 {run['decode_p90_ms']:.1f} ms, huge pages {run['huge_pages_mib']:.0f} MiB, "
                  f"peak RSS {run['peak_rss_mib']:.0f} MiB", flush=True)
    summary = {m: {k: statistics.median(run[k] for run in v) for k in ("tok_s", "decode_p50_ms", "decode_p90_ms",
                                                                      "huge_pages_mib", "peak_rss_mib")}
               for m, v in runs.items()}
    summary["ratio_4k_over_huge"] = summary["4k"]["tok_s"] / summary["huge"]["tok_s"]
    print(f"median tok/s: 4k {summary['4k']['tok_s']:.1f}, huge {summary['huge']['tok_s']:.1f} "
          f"({summary['ratio_4k_over_huge']:.2f}x)")
    Path(args.json).write_text(json.dumps({"bench": "first_touch", "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
