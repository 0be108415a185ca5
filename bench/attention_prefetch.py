"""The paged-attention kernel at its three prefetch levels, alternating in one run.

  none:   no software prefetch (the hardware's stream prefetchers only);
  task:   within a (row, KV head) task: the K/V runs of scattered blocks up front, and each block's
          V run while its keys are scored;
  next:   task, and the K runs of the task the thread takes next during this task's P.V pass (the
          default). The AMX kernel (a CPU with AMX) and the fma kernel (no bf16 instructions; 64-dim
          heads only: Gemma's 256-dim heads there prefetch nothing) have no next-task prefetch:
          there next is task.

A decode step at N rows (contexts of --keys keys, 100-350 by default, in a model's attention
shape: SmolLM2-135M's 9 query heads on 3 KV heads of 64 dims by default, or Gemma 3 270M's 4 on 1
of 256; 30 layers, bf16), read through two kinds of block tables:
  admission: each row's prompt blocks consecutive in the pool, its last 4 blocks taken one by one,
             round-robin with the other rows (what a batch admitted together looks like);
  scattered: every block anywhere (a long-running server's free list).
The levels take turns in a rotating order, each round starting with the next one, so a drift
of the machine does not always land on the same level. The outputs of every level are compared
bit for bit (a prefetch changes no result). A third
case, cached, runs the same rows and lengths with every row reading one table (its blocks stay in
cache): the kernel's arithmetic alone, the floor a prefetch can approach.

    .venv/bin/python bench/attention_prefetch.py [--rows 128] [--rounds 6] [--keys 100:350] [--shape smollm2]

Writes bench/results/attention_prefetch.json (other shapes and key ranges: a suffixed name). Run it
alone (2 cores).
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

SHAPES = {"smollm2": (3, 3, 64), "gemma3": (1, 4, 256)}  # (KV heads, query heads per KV head, head dim)
BS, LAYERS = 16, 30
DECODE_BLOCKS = 4
LEVELS = ("none", "task", "next")  # isolab_attention_prefetch(0, 1, 2)


def tables_for(kind: str, nblk: list[int], gen: torch.Generator) -> torch.Tensor:
    n, width = len(nblk), max(nblk)
    tables = torch.zeros(n, width, dtype=torch.int32)
    if kind == "admission":
        nxt = 0
        for r in range(n):
            pb = nblk[r] - DECODE_BLOCKS
            tables[r, :pb] = torch.arange(nxt, nxt + pb, dtype=torch.int32)
            nxt += pb
        for j in range(DECODE_BLOCKS):
            for r in range(n):
                tables[r, nblk[r] - DECODE_BLOCKS + j] = nxt
                nxt += 1
    else:
        perm = torch.randperm(sum(nblk), generator=gen).to(torch.int32)
        o = 0
        for r in range(n):
            tables[r, : nblk[r]] = perm[o : o + nblk[r]]
            o += nblk[r]
    return tables


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--keys", default="100:350", help="each row's context, LO:HI keys")
    ap.add_argument("--shape", default="smollm2", choices=tuple(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    HKV, G, DH = SHAPES[args.shape]
    lo, _, hi = args.keys.partition(":")
    if not (lo.isdigit() and hi.isdigit() and DECODE_BLOCKS * BS <= int(lo) < int(hi)):
        print(f"--keys wants LO:HI with {DECODE_BLOCKS * BS} <= LO < HI (each row ends with {DECODE_BLOCKS} "
              f"blocks of {BS} taken round-robin), got {args.keys!r}")
        return 2
    default = args.shape == "smollm2" and args.keys == "100:350"
    out_path = Path(args.out or Path(__file__).parent / "results" / (
        "attention_prefetch.json" if default else f"attention_prefetch_{args.shape}_{lo}-{hi}.json"))
    if not kernels.attention_prefetch(2):
        print("the prefetches are in the native kernels, which do not run here (torch's attention): "
              "nothing to compare")
        return 2
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(int(lo), int(hi), (args.rows,), generator=gen)
    nblk = [(int(x) + BS - 1) // BS for x in lens]
    tables = {k: tables_for(k, nblk, gen) for k in ("admission", "scattered")}
    tables["cached"] = tables["admission"][int(torch.tensor(nblk).argmax())].repeat(args.rows, 1).contiguous()
    pools = [torch.randn(2, HKV, sum(nblk), BS, DH, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    q = torch.randn(args.rows, HKV * G, DH, generator=gen).to(torch.bfloat16)
    row_table = torch.arange(args.rows, dtype=torch.int32)
    q_pos = (lens - 1).to(torch.int32)
    mb = int(lens.sum()) * LAYERS * 2 * HKV * DH * 2 / 1e6
    times: dict[str, list[float]] = {}
    first: dict[str, torch.Tensor] = {}
    try:
        for rnd in range(args.rounds):
            for kind, t in tables.items():
                for level in [(rnd + j) % len(LEVELS) for j in range(len(LEVELS))]:
                    name = LEVELS[level]
                    kernels.attention_prefetch(level)
                    step = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        for layer in range(LAYERS):
                            out = kernels.paged_attention(q, pools[layer], t, row_table, q_pos, DH**-0.5)
                        step.append(time.perf_counter() - t0)
                    if kind in first and not torch.equal(first[kind], out):
                        raise SystemExit("the prefetch changed the output: a kernel bug")
                    first.setdefault(kind, out)
                    times.setdefault(f"{kind}/{name}", []).append(statistics.median(step) * 1e3)
    finally:
        kernels.attention_prefetch(len(LEVELS) - 1)
    result = {"cpu": cpu_description(), "rows": args.rows, "layers": LAYERS, "shape": args.shape,
              "kv_heads": HKV, "group": G, "head_dim": DH, "keys": [int(lo), int(hi)],
              "mean_keys": float(lens.float().mean()), "mb_read_per_step": mb, "rounds": args.rounds, "cases": {}}
    for kind in tables:
        ms = {name: statistics.median(times[f"{kind}/{name}"]) for name in LEVELS}
        result["cases"][kind] = {**{f"{name}_ms": v for name, v in ms.items()},
                                 **{f"{name}_gb_per_s": mb / v for name, v in ms.items()},
                                 **{f"{name}_vs_none": v / ms["none"] for name, v in ms.items()},
                                 **{f"rounds_{name}_ms": times[f"{kind}/{name}"] for name in LEVELS}}
        print(f"{kind:9s} tables: " + "   ".join(f"{name} {v:6.1f} ms ({mb / v:4.1f} GB/s, {v / ms['none']:.2f}x)"
                                                 for name, v in ms.items()))
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
