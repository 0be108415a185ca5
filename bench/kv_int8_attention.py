"""The attention kernel alone over a 16-bit and an 8-bit K/V pool (kv_cache_dtype int8).

Decode rows of SmolLM2's shape (9 query heads, 3 KV heads, 64 dimensions, 16-key blocks), each row
with its own blocks scattered over the pool, contexts drawn around --context; one pool per layer
(--layers), so that a step reads its K/V from memory as the engine's does, not from cache. Both
pools hold the same blocks; rounds alternate the two, and the median of each is reported.

    .venv/bin/python bench/kv_int8_attention.py [--rows 128] [--context 240] [--layers 30]

Writes bench/results/kv_int8_attention.json (or --out). Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.models.attention import i8_pool_shape  # noqa: E402

H, HKV, DH, BS = 9, 3, 64, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--context", type=int, default=240, help="mean keys a row reads (drawn from 0.4x to 1.6x of it)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if min(args.rows, args.context, args.layers, args.rounds) < 1:
        print("--rows, --context, --layers and --rounds need at least 1")
        return 2
    if not kernels.native_ready():
        print("the native kernels do not build here: nothing to measure")
        return 2
    g = torch.Generator().manual_seed(0)
    n, hi = args.rows, int(args.context * 1.6) + 1
    per_row = -(-hi // BS)
    nb = n * per_row + 1  # block 0: the null block
    tables = (torch.randperm(nb - 1, generator=g)[: n * per_row] + 1).view(n, per_row).to(torch.int32)
    q_pos = torch.randint(int(args.context * 0.4), hi, (n,), generator=g).to(torch.int32)
    q = torch.randn(n, H, DH, generator=g).bfloat16()
    rows = torch.arange(n, dtype=torch.int32)
    pools: dict[str, list[torch.Tensor]] = {"bf16": [], "int8": []}
    for _ in range(args.layers):
        p16 = (torch.randn(2, HKV, nb, BS, DH, generator=g)).bfloat16()
        p8 = torch.randint(-127, 128, i8_pool_shape(HKV, nb, BS, DH), generator=g, dtype=torch.int8)
        scales = p8[..., BS * DH:].view(torch.float32)
        scales.copy_(torch.rand(scales.shape, generator=g) * 0.05)
        pools["bf16"].append(p16)
        pools["int8"].append(p8)
    times: dict[str, list[float]] = {"bf16": [], "int8": []}
    for r in range(args.rounds + 1):
        for name in ("bf16", "int8") if r % 2 else ("int8", "bf16"):
            t = time.perf_counter()
            for p in pools[name]:
                kernels.paged_attention(q, p, tables, rows, q_pos, DH**-0.5)
            if r:  # the first round warms
                times[name].append((time.perf_counter() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    kv_tokens = int(q_pos.sum()) + n
    out = {
        "machine": {"cpu": _cpu(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "attention_isa": kernels.attention_isa(), "rows": n, "layers": args.layers,
        "mean_context": kv_tokens / n,
        "bytes_read_MB": {"bf16": kv_tokens * args.layers * HKV * 2 * DH * 2 / 1e6,
                          "int8": kv_tokens * args.layers * HKV * 2 * (DH + 4) / 1e6},
        "ms_median": med, "ms_runs": times, "int8_over_bf16": med["int8"] / med["bf16"],
    }
    print(f"{n} decode rows, {args.layers} layers, mean context {kv_tokens / n:.0f} keys ({kernels.attention_isa()}): "
          f"bf16 pool {med['bf16']:.1f} ms, int8 pool {med['int8']:.1f} ms ({med['int8'] / med['bf16']:.2f}x); "
          f"{out['bytes_read_MB']['bf16']:.0f} / {out['bytes_read_MB']['int8']:.0f} MB of K/V")
    path = Path(args.out or Path(__file__).parent / "results" / "kv_int8_attention.json")
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
