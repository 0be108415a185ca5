"""A decode step's quantized GEMMs on the packed weights as the engine holds them (the weight cache's
files, mapped: 4 KiB pages) against the same bytes copied into one anonymous buffer advised
MADV_HUGEPAGE (2 MiB pages where transparent huge pages are `madvise` or `always`), in one process,
passes alternating, outputs compared bit for bit. What it asks: how much of a step goes to the TLB
misses of streaming 92 MB of weights through 4 KiB pages.

    .venv/bin/python bench/weight_pages.py [--model PATH] [--json bench/results/weight_pages.json]

Prints the huge pages the buffer got (AnonHugePages); a machine where THP is `never` gets none and
measures nothing. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.models.bundle import load_bundle  # noqa: E402
from isolab.models.linear import QuantWeight  # noqa: E402

HUGE = 2 << 20


def anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default="bench/results/weight_pages.json")
    args = ap.parse_args()
    m = load_bundle(args.model, "bf16", weights="native").model
    ws = [w for lyr in m.layers for w in (lyr.wqkv, lyr.wo, lyr.w_gate_up, lyr.w_down)] + [m.lm_head]
    ws = [w for w in ws if isinstance(w, QuantWeight) and w.packed is not None]
    total = sum(w.packed.numel() for w in ws)
    before = anon_huge_kib()
    buf = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(buf, dtype=np.uint8)
    off = (-arr.ctypes.data) % HUGE  # the first weight at a 2 MiB boundary
    huge = []
    for w in ws:
        n = w.packed.numel()
        t = torch.from_numpy(arr[off:off + n]).view(w.packed.shape)
        t.copy_(w.packed)
        huge.append(t)
        off += n
    got = anon_huge_kib() - before
    print(f"{total / 2**20:.1f} MiB of packed weights; the copy got {got / 1024:.0f} MiB of huge pages", flush=True)
    lib = kernels._library()
    assert lib is not None, "the native kernels did not build"
    rows = []
    for mm, passes in ((1, 80), (8, 30), (32, 12)):
        xs = [torch.randn(mm, w.packed.shape[1] * 32).to(torch.bfloat16) for w in ws]
        outs = {v: [torch.empty(mm, w.n, dtype=torch.bfloat16) for w in ws] for v in ("mapped", "huge")}
        packs = {"mapped": [w.packed for w in ws], "huge": huge}

        def run(v: str, mm: int = mm, xs: list = xs, outs: dict = outs, packs: dict = packs) -> float:
            t = time.perf_counter()
            for w, p, x, o in zip(ws, packs[v], xs, outs[v], strict=True):
                k = x.shape[1]
                lib.isolab_qgemm(x.data_ptr(), 1, k, p.data_ptr(), w.fmt, w.fp16, o.data_ptr(), 1, mm, w.n, k)
            return (time.perf_counter() - t) * 1e3

        ms: dict[str, list[float]] = {"mapped": [], "huge": []}
        for i in range(2 * passes + 2):
            v = "huge" if i % 2 else "mapped"
            dt = run(v)
            if i >= 2:
                ms[v].append(dt)
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(outs["mapped"], outs["huge"], strict=True))
        a, b = statistics.median(ms["mapped"]), statistics.median(ms["huge"])
        rows.append({"m": mm, "passes_each": passes, "mapped_ms": round(a, 3), "huge_ms": round(b, 3),
                     "speedup": round(a / b, 3), "same_bits": same})
        print(f"M={mm:<3d} a step's GEMMs: mapped {a:7.2f} ms, huge pages {b:7.2f} ms, {a / b:5.3f}x, same bits: {same}",
              flush=True)
    out = {"model": str(args.model or "smollm2-135m-instruct"), "threads": torch.get_num_threads(),
           "packed_mib": round(total / 2**20, 1), "huge_pages_mib": round(got / 1024), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
