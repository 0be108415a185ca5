"""The quantized GEMM of two builds of the kernels, side by side in one process: the sources at a git
revision (default HEAD) against the working tree's, each compiled with the engine's own flags for
this CPU, on the model's own packed weights. Calls alternate between the two builds, so a shared
machine's drift falls on both alike; every output is compared bit for bit (a kernel change that
is meant to change no bit must show `same_bits: true` everywhere).

    .venv/bin/python bench/kernel_builds_ab.py [--base HEAD] [--isa native] [--json PATH]

Two parts: each of the first layer's GEMMs and the vocabulary head alone at M = 1, 8 and 32 (median
ms of each build), then a decode step's GEMMs (every layer's four in order and the head, so each
weight comes from memory as in a step) at M = 1, 8 and 32. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from isolab import kernels  # noqa: E402
from isolab.models.bundle import load_bundle  # noqa: E402
from isolab.models.linear import QuantWeight  # noqa: E402


def compile_at(rev: str | None, isa: str, tmp: Path) -> ctypes.CDLL:
    """The kernels' sources at git revision rev (None: the working tree) compiled into tmp."""
    folder = tmp / (rev or "worktree").replace("/", "_")
    folder.mkdir()
    for path in kernels.SOURCES + kernels.HEADERS:
        if rev is None:
            text = path.read_bytes()
        else:
            rel = path.relative_to(ROOT).as_posix()
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True,
                                  check=True).stdout
        (folder / path.name).write_bytes(text)
    so = folder / "kernels.so"
    flags = (*kernels.FLAGS, *kernels.ISA_LEVELS[isa][0])
    res = subprocess.run(["g++", *flags, *(str(folder / p.name) for p in kernels.SOURCES), "-o", str(so)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"the build of {rev or 'the working tree'} failed: {res.stderr.strip()[-600:]}")
    lib = ctypes.CDLL(str(so))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.isolab_qgemm.restype = None
    lib.isolab_qgemm.argtypes = [p, i32, i64, p, i32, i32, p, i32, i32, i32, i32]
    return lib


def call(lib: ctypes.CDLL, x: torch.Tensor, w: QuantWeight, out: torch.Tensor) -> None:
    k = x.shape[1]
    lib.isolab_qgemm(x.data_ptr(), 1, k, w.packed.data_ptr(), w.fmt, w.fp16, out.data_ptr(), 1, x.shape[0], w.n, k)


def paired(libs: dict[str, ctypes.CDLL], work: list[tuple[torch.Tensor, QuantWeight]], passes: int) -> dict:
    """Median ms of one pass over work with each build, passes alternating; outputs compared."""
    outs = {name: [torch.empty(x.shape[0], w.n, dtype=torch.bfloat16) for x, w in work] for name in libs}
    ms: dict[str, list[float]] = {name: [] for name in libs}
    names = list(libs)
    for i in range(2 * passes + 2):
        name = names[i % 2]
        t = time.perf_counter()
        for (x, w), o in zip(work, outs[name], strict=True):
            call(libs[name], x, w, o)
        if i >= 2:
            ms[name].append((time.perf_counter() - t) * 1e3)
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*outs.values(), strict=True))
    base, new = (statistics.median(ms[n]) for n in names)
    return {"base_ms": round(base, 4), "new_ms": round(new, 4), "speedup": round(base / new, 3),
            "passes_each": passes, "same_bits": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base build (default HEAD)")
    ap.add_argument("--isa", default="native", choices=sorted(kernels.ISA_LEVELS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default="bench/results/kernel_builds_ab.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="isolab-builds-ab-") as tmp:
        libs = {"base": compile_at(args.base, args.isa, Path(tmp)), "new": compile_at(None, args.isa, Path(tmp))}
        m = load_bundle(args.model, "bf16", weights="native").model
        g = torch.Generator().manual_seed(0)
        layer = m.layers[0]
        alone = []
        for name, w in (("wqkv", layer.wqkv), ("wo", layer.wo), ("w_gate_up", layer.w_gate_up),
                        ("w_down", layer.w_down), ("lm_head", m.lm_head)):
            if not isinstance(w, QuantWeight) or w.packed is None:
                continue
            for mm in (1, 8, 32):
                x = torch.randn(mm, w.packed.shape[1] * 32, generator=g).to(torch.bfloat16)
                reps = min(200, max(8, int(4e9 // (mm * w.n * x.shape[1]))))
                row = {"weight": name, "format": w.qtype, "m": mm, **paired(libs, [(x, w)], reps)}
                alone.append(row)
                print(f"{name:10s} {w.qtype:6s} M={mm:<3d} base {row['base_ms']:8.3f} ms  new {row['new_ms']:8.3f} ms"
                      f"  {row['speedup']:5.3f}x  same bits: {row['same_bits']}", flush=True)
        step_ws = [w for lyr in m.layers for w in (lyr.wqkv, lyr.wo, lyr.w_gate_up, lyr.w_down)] + [m.lm_head]
        step_ws = [w for w in step_ws if isinstance(w, QuantWeight) and w.packed is not None]
        step = []
        for mm, passes in ((1, 60), (8, 30), (32, 16)):
            work = [(torch.randn(mm, w.packed.shape[1] * 32, generator=g).to(torch.bfloat16), w) for w in step_ws]
            row = {"m": mm, "gemms": len(work), **paired(libs, work, passes)}
            step.append(row)
            print(f"a step's GEMMs M={mm:<3d} base {row['base_ms']:7.2f} ms  new {row['new_ms']:7.2f} ms"
                  f"  {row['speedup']:5.3f}x  same bits: {row['same_bits']}", flush=True)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], capture_output=True,
                         text=True).stdout.strip()
    out = {"base": rev or args.base, "new": "working tree", "isa": args.isa, "threads": torch.get_num_threads(),
           "model": str(args.model or "smollm2-135m-instruct"), "alone": alone, "step": step}
    target = Path(args.json)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    print(f"wrote {target}")
    return 0 if all(r["same_bits"] for r in alone + step) else 1


if __name__ == "__main__":
    sys.exit(main())
