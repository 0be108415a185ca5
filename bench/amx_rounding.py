"""How the tile unit rounds a bf16 dot product: TDPBF16PS on random operands against five exact models
of its rounding (computed in fp64), counting the fp32 outputs whose bits differ from each. None
matching is why a dense row cannot leave the tile unit for an AVX-512 loop with the same bits
(docs/engine.md, "Dense weights in their blocks"). Needs a CPU with AMX-BF16 and g++.

    .venv/bin/python bench/amx_rounding.py [--json bench/results/amx_rounding.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <sys/syscall.h>
struct Cfg { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
extern "C" int amx_init() { return syscall(SYS_arch_prctl, 0x1023, 18); }  // ARCH_REQ_XCOMP_PERM, XTILEDATA
// a: chunks x 16 x 32 bf16 (row m, k); b: chunks x 16 k pairs x 16 columns x 2; c: 16 x 16 fp32 in/out
extern "C" void tdp(const uint16_t* a, const uint16_t* b, float* c, int chunks) {
    Cfg cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    for (int t = 0; t < 3; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    _tile_loadd(0, c, 64);
    for (int i = 0; i < chunks; i++) {
        _tile_loadd(1, a + i * 512, 64);
        _tile_loadd(2, b + i * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    _tile_release();
}
"""


def bf16(x: np.ndarray) -> np.ndarray:
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def widen(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def models(c0: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """p: (chunks, 16, 16, 32) exact products; each model's fp32 result from c0."""
    f32 = lambda x: np.asarray(x, np.float64).astype(np.float32)  # noqa: E731  one rounding to fp32
    out = {}
    c = c0.copy()
    for ch in range(p.shape[0]):
        for k in range(32):
            c = f32(c.astype(np.float64) + p[ch, :, :, k])
    out["one rounding a product, in k order"] = c
    c = c0.copy()
    for ch in range(p.shape[0]):
        for i in range(16):
            c = f32(c.astype(np.float64) + f32(p[ch, :, :, 2 * i] + p[ch, :, :, 2 * i + 1]).astype(np.float64))
    out["a pair rounded, then added"] = c
    c = c0.copy()
    for ch in range(p.shape[0]):
        for i in range(16):
            c = f32(c.astype(np.float64) + (p[ch, :, :, 2 * i] + p[ch, :, :, 2 * i + 1]))
    out["a pair and C, one rounding"] = c
    exact = lambda c, ch: np.array([[math.fsum([float(c[m, n]), *p[ch, m, n]]) for n in range(16)]  # noqa: E731
                                     for m in range(16)])
    c = c0.copy()
    for ch in range(p.shape[0]):
        c = f32(exact(c, ch))
    out["the chunk and C, one rounding"] = c
    c = c0.copy()
    for ch in range(p.shape[0]):
        chunk = f32(exact(np.zeros_like(c), ch)).astype(np.float64)
        c = f32(c.astype(np.float64) + chunk)
    out["the chunk rounded, then added"] = c
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=20)
    ap.add_argument("--json", default="bench/results/amx_rounding.json")
    args = ap.parse_args()
    if "amx_bf16" not in Path("/proc/cpuinfo").read_text():
        print("this CPU has no AMX-BF16: nothing to measure")
        return 0
    build = Path(tempfile.mkdtemp(prefix="isolab-amx-"))
    (build / "probe.cpp").write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-mamx-tile", "-mamx-bf16", "-o", str(build / "probe.so"),
                    str(build / "probe.cpp")], check=True)
    lib = ctypes.CDLL(str(build / "probe.so"))
    assert lib.amx_init() == 0, "the OS refused the tile data permission"
    lib.tdp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    rng = np.random.default_rng(0)
    results = {}
    for spread in (0, 2, 6):  # operands' exponents in [-spread, spread]
        differ: dict[str, int] = {}
        outputs, worst = 0, 0.0
        for t in range(args.tiles):
            chunks = 1 + t % 2
            shape = (chunks, 16, 32)
            a = bf16(rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape))
            w = bf16(rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape))  # w[n][k]
            b = np.ascontiguousarray(w.reshape(chunks, 16, 16, 2).transpose(0, 2, 1, 3))
            c0 = (rng.standard_normal((16, 16)) * 4).astype(np.float32) if t % 2 else np.zeros((16, 16), np.float32)
            c = c0.copy()
            lib.tdp(a.ctypes.data, b.ctypes.data, c.ctypes.data, chunks)
            p = widen(a)[:, :, None, :] * widen(w)[:, None, :, :]  # exact products
            for name, got in models(c0, p).items():
                differ[name] = differ.get(name, 0) + int((got.view(np.uint32) != c.view(np.uint32)).sum())
            if chunks == 1 and not t % 2:
                ex = np.array([[math.fsum(p[0, m, n]) for n in range(16)] for m in range(16)])
                ulp = np.spacing(np.abs(ex).astype(np.float32)).astype(np.float64)
                worst = max(worst, float(np.max(np.abs(c.astype(np.float64) - ex) / ulp)))
            outputs += 256
        results[f"exponents within 2^+-{spread}"] = {"outputs": outputs, "differ": differ, "worst_ulps_vs_exact": worst}
        print(f"exponents within 2^+-{spread}: {outputs} outputs; worst {worst:.0f} ulps from the exact sum")
        for name, n in differ.items():
            print(f"  {name:34s} differs in {n:5d} ({100 * n / outputs:.1f}%)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo")
                                                         .read_text().splitlines() if ln.startswith("model name")), ""),
                                           "tiles": args.tiles, "results": results}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
