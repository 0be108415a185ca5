"""How close the quantized GEMM (kernels/qgemm.cpp) runs to the CPU's int8 dot-product ceiling.

1. The ceiling: a loop of `vpdpbusd` on 12 independent zmm accumulators (nothing else), compiled
   here with the kernels' compiler and -march=native, run on one core and then on every core at
   once: GMAC/s (64 int8 multiply-adds an instruction). The same loop with `vmulps` in place and
   with both interleaved says whether the two share the vector pipes (then every multiply of the
   fold costs a dot product's slot). Then the fold's own mix: for each 8 `vpdpbusd`, 3 `vmulps`
   and 2 `vaddps` (a u4 block of a row and panel: Q4_0, Q4_1, Q4_K) or 2 and 1 (s8: Q8_0): the
   dot products' rate in that mix over their rate alone is the most a fold of that shape leaves.
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
  const int mode = atoi(argv[1]);  // 0 dpbusd, 1 mulps, 2 both, 3 the u4 fold's mix, 4 the s8 fold's
  const long n = 100000000 / 12;
  if (mode >= 3) {  // a block's mix: 8 dot products, then NM multiplies and NA adds, each its own chain
    const int nm = mode == 3 ? 3 : 2, na = mode == 3 ? 2 : 1;
    __m512i d[8]; __m512 mu[3], ad[2];
    for (int i = 0; i < 8; i++) d[i] = _mm512_set1_epi32(i);
    for (int i = 0; i < 3; i++) mu[i] = _mm512_set1_ps(1.0f + i);
    for (int i = 0; i < 2; i++) ad[i] = _mm512_set1_ps((float)i);
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    __m512 m = _mm512_set1_ps(1.0000001f);
    const long iters = 100000000 / 8;
    auto t = std::chrono::steady_clock::now();
    for (long i = 0; i < iters; i++) {
      _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) d[j] = _mm512_dpbusd_epi32(d[j], a, b);
      for (int j = 0; j < nm; j++) mu[j] = _mm512_mul_ps(mu[j], m);
      for (int j = 0; j < na; j++) ad[j] = _mm512_add_ps(ad[j], m);
      __asm__ volatile("" : "+v"(a), "+v"(m));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    int x = 0; float y = 0;
    for (int i = 0; i < 8; i++) x += _mm512_reduce_add_epi32(d[i]);
    for (int i = 0; i < 3; i++) y += _mm512_reduce_add_ps(mu[i]);
    for (int i = 0; i < 2; i++) y += _mm512_reduce_add_ps(ad[i]);
    printf("%.6f %d %f\n", iters * 8 / s / 1e9, x, y);  // G dot products per second, in the mix
    return 0;
  }
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

    from isolab.kernels import quant as Q
    from isolab.models.bundle import load_bundle
    from isolab.models.linear import QuantWeight

    cores = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.cpp", Path(tmp) / "loop"
        src.write_text(LOOP)
        subprocess.run([cxx, "-O3", "-march=native", str(src), "-o", str(exe)], check=True)
        one = {name: ceiling(exe, mode, 1)
               for mode, name in enumerate(("dpbusd", "mulps", "both", "u4_fold_mix", "s8_fold_mix"))}
        every = ceiling(exe, 0, cores)
    per_core_gmac = one["dpbusd"] * 64
    peak = every * 64 * cores
    print(f"vpdpbusd zmm: {one['dpbusd']:.2f} G/s on one core ({per_core_gmac:.0f} GMAC/s); "
          f"{every:.2f} G/s a core on average with {cores} running ({peak:.0f} GMAC/s in all)")
    print(f"vmulps alone {one['mulps']:.2f} G/s; dpbusd and vmulps interleaved {one['both']:.2f} G/s each "
          f"({'they share the pipes' if one['both'] < 0.75 * min(one['dpbusd'], one['mulps']) else 'they overlap'})")
    u4_ceiling, s8_ceiling = one["u4_fold_mix"] / one["dpbusd"], one["s8_fold_mix"] / one["dpbusd"]
    print(f"in the fold's mix (8 dpbusd with 3 vmulps and 2 vaddps: u4; with 2 and 1: s8) dpbusd runs "
          f"{one['u4_fold_mix']:.2f} / {one['s8_fold_mix']:.2f} G/s: {u4_ceiling:.0%} / {s8_ceiling:.0%} of its rate "
          f"alone, the most a u4 / s8 GEMM can reach ({u4_ceiling * peak:.0f} / {s8_ceiling * peak:.0f} GMAC/s)")
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
            # the fold's ceiling where the mix above is its shape (S8G16, Q6_K: 4 multiplies a block)
            fold = {Q.U4: u4_ceiling, Q.S8: s8_ceiling}.get(w.fmt)
            rows.append({"weight": name, "format": w.qtype, "n": w.n, "k": k, "m": mm, "ms": round(best * 1e3, 4),
                         "gmac_per_s": round(gmac, 1), "share_of_ceiling": round(gmac / peak, 3),
                         "share_of_fold_ceiling": round(gmac / (peak * fold), 3) if fold else None})
            print(f"{name:10s} {w.qtype:5s} M={mm:<4d} {gmac:6.1f} GMAC/s  {gmac / peak:5.1%} of the ceiling"
                  + (f", {gmac / (peak * fold):5.1%} of its fold's" if fold else ""))
    out = {"cores": cores, "dpbusd_g_per_s_one_core": one["dpbusd"], "mulps_g_per_s_one_core": one["mulps"],
           "both_interleaved_g_per_s": one["both"], "dpbusd_g_per_s_per_core_all_running": every,
           "ceiling_gmac_per_s": peak, "u4_fold_mix_dpbusd_g_per_s": one["u4_fold_mix"],
           "s8_fold_mix_dpbusd_g_per_s": one["s8_fold_mix"], "u4_fold_ceiling": u4_ceiling,
           "s8_fold_ceiling": s8_ceiling, "rows": rows}
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/vnni_ceiling.json").write_text(json.dumps(out, indent=1))
    print("wrote bench/results/vnni_ceiling.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
