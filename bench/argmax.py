"""Greedy sampling's argmax over the vocabulary: torch.argmax against isolab's native one.

At 128 rows of SmolLM2's 49,152 logits: torch.argmax on fp32 and on bf16, widening bf16 to fp32
(what the sampler did before it took the head's own dtype), and kernels.argmax_rows on both, with
the answers compared. Alternating, median of --reps calls each.

    .venv/bin/python bench/argmax.py [--rows 128] [--vocab 49152]

Writes bench/results/argmax.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.models.invariance import cpu_description  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "argmax.json"))
    args = ap.parse_args()
    if not kernels.native_ready():
        print("the native kernels are not built here (no C++ compiler, or ISOLAB_NATIVE=0): nothing to compare")
        return 2
    x32 = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    x16 = x32.bfloat16()
    cases = {
        "torch_argmax_fp32": lambda: torch.argmax(x32, dim=-1),
        "torch_argmax_bf16": lambda: torch.argmax(x16, dim=-1),
        "widen_bf16_to_fp32": lambda: x16.float(),
        "native_argmax_fp32": lambda: kernels.argmax_rows(x32),
        "native_argmax_bf16": lambda: kernels.argmax_rows(x16),
    }
    if not (torch.equal(kernels.argmax_rows(x32), torch.argmax(x32, dim=-1))
            and torch.equal(kernels.argmax_rows(x16), torch.argmax(x16, dim=-1))):
        print("the native argmax disagrees with torch.argmax: a kernel bug")
        return 1
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(3):
        for f in cases.values():
            f()
    for _ in range(args.reps):
        for name, f in cases.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in ms.items():
        print(f"{k:22s} {v:7.3f} ms")
    result = {"cpu": cpu_description(), "rows": args.rows, "vocab": args.vocab, "threads": torch.get_num_threads(),
              "median_ms": ms}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
