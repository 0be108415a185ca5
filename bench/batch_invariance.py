"""Batch invariance and speed of every GEMM path, per ISA level this CPU can run (docs/engine.md, "Numerics").

For each level (oneDNN capped with ONEDNN_MAX_CPU_ISA; isolab's kernels built with
ISOLAB_KERNEL_ISA), each GEMM path (models/linear.py) and dtype, in a fresh subprocess:
  - differing outputs: the start-up check of models/invariance.py on SmolLM2-135M's shapes (a row
    in slices of M = 1, 2, 3, 5, 9, 17, 32, 33, 64, 128, 512 against the same rows in one call),
    summed over shapes and M (0 = batch-invariant);
  - ms for one step's GEMMs at M rows: 30 layers x (qkv, o, gate_up, down), each layer its own
    weights (so they stream from memory as in the engine), plus the vocabulary head.
Prints a table, writes bench/results/batch_invariance.json.

    python bench/batch_invariance.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30
STEP_M = (1, 32, 128, 512)
SLOW_S = 3.0  # once one step takes longer, larger M are not timed for that path


def measure(path: str, dname: str, quick: bool) -> dict:
    import torch

    from isolab import kernels
    from isolab.models import invariance
    from isolab.models.linear import Weight, path_applies

    dtype = torch.bfloat16 if dname == "bf16" else torch.float32
    cpu = torch.device("cpu")
    native = kernels.available(cpu, dtype, 9, 3, 64)
    if not path_applies(path, cpu, dtype, native):  # type: ignore[arg-type]
        return {"applies": False}
    rep = invariance.check(path, LAYER_SHAPES + [HEAD], dtype, cpu, (9, 3, 64), native, use_cache=False)
    out: dict = {"applies": True, "mismatches": sum(v for per in rep.gemm_mismatches.values() for v in per.values()),
                 "by_shape": rep.gemm_mismatches, "kernel_isa": rep.kernel_isa, "check_s": rep.seconds, "step_ms": {}}
    g = torch.Generator().manual_seed(0)
    layers = [[Weight(torch.randn(n, k, generator=g).to(dtype), path) for n, k in LAYER_SHAPES]
              for _ in range(2 if quick else LAYERS)]
    head = Weight(torch.randn(*HEAD, generator=g).to(dtype), path)
    scale = LAYERS / len(layers)
    for m in STEP_M:
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (576, 1536)}

        def step(xs: dict = xs) -> None:  # xs bound now: this M's inputs
            for ws in layers:
                for w, (_, k) in zip(ws, LAYER_SHAPES, strict=True):
                    w(xs[k])
            head(xs[576])

        step()
        best = float("inf")
        t_end = time.perf_counter() + (0.5 if quick else 2.0)
        while True:
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            best = min(best, dt)
            if time.perf_counter() > t_end:
                break
        # head once, layers scaled to 30 when --quick built fewer
        t0 = time.perf_counter()
        head(xs[576])
        head_s = time.perf_counter() - t0
        ms = ((best - head_s) * scale + head_s) * 1e3
        out["step_ms"][str(m)] = round(ms, 2)
        if ms / 1e3 > SLOW_S:
            break
    return out


def child(args: argparse.Namespace) -> None:
    print(json.dumps(measure(args.path, args.dtype, args.quick)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers timed and scaled to 30, shorter timing")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="isolab", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from isolab import kernels
    from isolab.models.invariance import cpu_description

    flags = kernels._cpu_flags()
    caps = [c for c, f in (("AVX2", "avx2"), ("AVX512_CORE", "avx512f"), ("AVX512_CORE_BF16", "avx512_bf16"),
                           ("AVX512_CORE_AMX", "amx_bf16")) if f in flags]
    levels = kernels.isa_levels()
    runs: list[tuple[str, dict[str, str], str]] = []  # (label, env, path)
    for cap in caps:  # oneDNN-backed paths under each cap (isolab's kernels at native)
        for path in ("onednn", "torch", "fixed-tile"):
            runs.append((f"oneDNN {cap}", {"ONEDNN_MAX_CPU_ISA": cap}, path))
    for lv in levels:  # isolab's GEMM at each level its kernels build for
        runs.append((f"isolab {lv}", {"ISOLAB_KERNEL_ISA": lv}, "isolab"))
    result: dict = {"cpu": cpu_description(), "levels": levels, "onednn_caps": caps, "rows": []}
    print(f"CPU: {result['cpu']}")
    print(f"{'level':24} {'path':11} {'dtype':5} {'differing':>10} " + " ".join(f"{'M=' + str(m) + ' ms':>11}" for m in STEP_M))
    for label, env, path in runs:
        for dname in ("bf16", "fp32"):
            cmd = [sys.executable, __file__, "--child", "--path", path, "--dtype", dname] + (["--quick"] if args.quick else [])
            res = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                print(f"{label:24} {path:11} {dname:5} failed: {res.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            if not r["applies"]:
                continue
            result["rows"].append({"level": label, "env": env, "path": path, "dtype": dname, **r})
            times = " ".join(f"{r['step_ms'].get(str(m), '-'):>11}" for m in STEP_M)
            print(f"{label:24} {path:11} {dname:5} {r['mismatches']:>10} {times}", flush=True)
    out = ROOT / "bench" / "results" / "batch_invariance.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
