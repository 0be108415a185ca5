"""How close the quantized GEMM (kernels/qgemm.cpp) runs to the CPU's int8 dot-product ceiling.

1. The ceiling: a loop of `vpdpbusd` on 12 independent zmm accumulators (nothing else), compiled
   here with the kernels' compiler and -march=native, run on one core and then on every core at
   once: GMAC/s (64 int8 multiply-adds an instruction). The same loop with `vmulps` in place and
   with both interleaved says whether the two share the vector pipes (then every float op of the
   fold costs a dot product's slot).
2. The kernel: each weight of layer 0 and the vocabulary head at M = 32 and 128 rows, on all
   threads, GMAC/s, and its share of the ceiling.

    .venv/bin/python bench/vnni_ceiling.py

Writes bench/results/vnni_ceiling.json. Needs AVX512-VNNI and g++; says so and exits 0 without.
Run it alone (2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOOP = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  const int mode = atoi(argv[1]);  // 0 dpbusd, 1 mulps, 2 both
  const long n = 100000000 / 12;
  __m512i acc[12]; __m512 f[12];
  for (int i = 0; i < 12; i++) { acc[i] = _mm512_set1_epi32(i); f[i] = _mm512_set1_ps((float)i); }
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  __m512 m = _mm512_set1_ps(1.0000001f);
  auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < n; i++) {
    if (mode != 1) { _Pragma("GCC unroll 12") for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b); }
    if (mode != 0) { _Pragma("GCC unroll 12") for (int j = 0; j < 12; j++) f[j] = _mm512_mul_ps(f[j], m); }
    __asm__ volatile("" : "+v"(a), "+v"(m));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  int x = 0; float y = 0;
  for (int i = 0; i < 12; i++) { x += _mm512_reduce_add_epi32(acc[i]); y += _mm512_reduce_add_ps(f[i]); }
  printf("%.6f %d %f\n", n * 12 / s / 1e9, x, y);  // G iterations-of-12 per second (per instruction stream)
}
"""


def ceiling(binary: Path, mode: int, procs: int) -> float:
    """G instructions/s a stream, the mean of `procs` streams run at once (best of 3 tries)."""
    best = 0.0
    for _ in range(3):
        ps = [subprocess.Popen([str(binary), str(mode)], stdout=subprocess.PIPE, text=True) for _ in range(procs)]
        best = max(best, sum(float(p.communicate()[0].split()[0]) for p in ps) / procs)
    return best


def main() -> int:
    flags = Path("/proc/cpuinfo").read_text()
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if "avx512_vnni" not in flags or cxx is None:
        print("vnni_ceiling: this CPU has no AVX512-VNNI or there is no g++; nothing to measure")
        return 0
    import torch

    from isolab.models.bundle import load_bundle
    from isolab.models.linear import QuantWeight

    cores = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.cpp", Path(tmp) / "loop"
        src.write_text(LOOP)
        subprocess.run([cxx, "-O3", "-march=native", str(src), "-o", str(exe)], check=True)
        one = {name: ceiling(exe, mode, 1) for mode, name in enumerate(("dpbusd", "mulps", "both"))}
        every = ceiling(exe, 0, cores)
    per_core_gmac = one["dpbusd"] * 64
    peak = every * 64 * cores
    print(f"vpdpbusd zmm: {one['dpbusd']:.2f} G/s on one core ({per_core_gmac:.0f} GMAC/s); "
          f"{every:.2f} G/s a core on average with {cores} running ({peak:.0f} GMAC/s in all)")
    print(f"vmulps alone {one['mulps']:.2f} G/s; dpbusd and vmulps interleaved {one['both']:.2f} G/s each "
          f"({'they share the pipes' if one['both'] < 0.75 * min(one['dpbusd'], one['mulps']) else 'they overlap'})")
    m = load_bundle(None, "bf16", weights="native").model
    layer = m.layers[0]
    rows = []
    for name, w in (("wqkv", layer.wqkv), ("wo", layer.wo), ("w_gate_up", layer.w_gate_up),
                    ("w_down", layer.w_down), ("lm_head", m.lm_head)):
        if not isinstance(w, QuantWeight) or w.packed is None:
            continue
        k = w.packed.shape[1] * 32
        for mm in (32, 128):
            x = torch.randn(mm, k).to(torch.bfloat16)
            w(x)
            reps = max(3, int(2e9 // (mm * k * w.n)))
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    w(x)
                best = min(best, (time.perf_counter() - t) / reps)
            gmac = mm * k * w.n / best / 1e9
            rows.append({"weight": name, "format": w.qtype, "n": w.n, "k": k, "m": mm, "ms": round(best * 1e3, 4),
                         "gmac_per_s": round(gmac, 1), "share_of_ceiling": round(gmac / peak, 3)})
            print(f"{name:10s} {w.qtype:5s} M={mm:<4d} {gmac:6.1f} GMAC/s  {gmac / peak:5.1%} of the ceiling")
    out = {"cores": cores, "dpbusd_g_per_s_one_core": one["dpbusd"], "mulps_g_per_s_one_core": one["mulps"],
           "both_interleaved_g_per_s": one["both"], "dpbusd_g_per_s_per_core_all_running": every,
           "ceiling_gmac_per_s": peak, "rows": rows}
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/vnni_ceiling.json").write_text(json.dumps(out, indent=1))
    print("wrote bench/results/vnni_ceiling.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
