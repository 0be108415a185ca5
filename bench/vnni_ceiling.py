"""The most the quantized GEMM's inner loop can do on this CPU, as int8 multiply-adds a second.

Builds bench/native/vnni_ceiling.cpp (the system C++ compiler, -march=native) and runs it on 1
and on all of torch's threads: AVX-512 VNNI dot products alone, and mixed with the fp32 multiplies
and adds of qgemm.cpp's fold (a u4 block: 8 dot products and 3 multiplies a row and panel; an s8
block: 8 and 2). The ratio of mixed to alone is the ceiling the fold leaves; bench/qgemm.py's
figures are then read against it.

    .venv/bin/python bench/vnni_ceiling.py [--json bench/results/vnni_ceiling.json]

Run it alone (2 cores). A CPU without AVX-512 VNNI gets one sentence and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench/results/vnni_ceiling.json")
    args = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text().split("\n\n")[0] if Path("/proc/cpuinfo").exists() else ""
    if "avx512_vnni" not in flags or shutil.which("g++") is None:
        print("this bench needs AVX-512 VNNI and g++; this machine lacks one of them")
        return 2
    src = Path(__file__).with_name("native") / "vnni_ceiling.cpp"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "vnni_ceiling"
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        runs = []
        for threads in sorted({1, torch.get_num_threads()}):
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    for r in runs:
        r["gmac_per_s"] = round(r["dots_per_ns"] * 64, 1)
        r["u4_fold_ceiling"] = round(r["u4_fold_dots_per_ns"] / r["dots_per_ns"], 3)
        r["s8_fold_ceiling"] = round(r["s8_fold_dots_per_ns"] / r["dots_per_ns"], 3)
        print(f"{r['threads']} thread(s): {r['dots_per_ns']:.2f} dot products a ns ({r['gmac_per_s']:.0f} GMAC/s); "
              f"with a u4 fold {r['u4_fold_ceiling']:.0%} of that ({r['u4_fold_dots_per_ns'] * 64:.0f} GMAC/s), "
              f"with an s8 fold {r['s8_fold_ceiling']:.0%} ({r['s8_fold_dots_per_ns'] * 64:.0f} GMAC/s)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": platform_cpu(), "runs": runs}, indent=1))
    print(f"wrote {args.json}")
    return 0


def platform_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
