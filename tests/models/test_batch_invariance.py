"""Batch invariance by construction, verified where it runs (docs/engine.md, "Numerics").

- isolab's GEMM gives a row the same bits at every M, at every ISA level this CPU can run
  (ISOLAB_KERNEL_ISA forced down in subprocesses), and the same bits across levels that share the
  fma chain (AMX tiles are a chain of their own);
- under every oneDNN ISA cap this CPU can emulate (ONEDNN_MAX_CPU_ISA), the engine's start-up
  check picks a path that passes;
- a GEMM whose reduction order depends on M (the batch-variant-gemm fault's split-k) is detected
  and refused, and the verdict is cached per machine and shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from isolab import kernels
from isolab.models import invariance
from isolab.models.linear import Weight

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.float32, 4, 2, 64),
                                reason="native kernels do not build here")

SMOL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_isolab_gemm_gives_a_row_the_same_bits_at_every_m(dtype):
    g = torch.Generator().manual_seed(0)
    w = Weight(torch.randn(576, 1536, generator=g).to(dtype), "isolab")
    x = torch.randn(256, 1536, generator=g).to(dtype)
    full = w(x)
    for m in (1, 2, 3, 5, 9, 17, 33, 64):
        for s in range(0, 256 - m + 1, m):
            assert torch.equal(w(x[s : s + m]), full[s : s + m]), (m, s)
    # the padding columns of a width that is not a multiple of the panel are never written
    w2 = Weight(torch.randn(50, 64, generator=g).to(dtype), "isolab")
    assert w2(x[:3, :64]).shape == (3, 50)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_isolab_gemm_is_close_to_the_exact_product(dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=g).to(dtype)
    x = torch.randn(37, 96, generator=g).to(dtype)
    exact = x.double() @ w.double().T
    got = Weight(w, "isolab")(x).double()
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((got - exact).abs() <= tol * exact.abs() + 1e-4).all()


_LEVEL_SCRIPT = """
import sys, torch
from isolab import kernels
from isolab.models.linear import Weight
from isolab.models.attention import write_kv
g = torch.Generator().manual_seed(2)
out = {"isa": kernels.gemm_isa(), "bf16_dot": kernels.attention_bf16_dot(), "attention_isa": kernels.attention_isa()}
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    w = torch.randn(130, 576, generator=g).to(dt)
    x = torch.randn(19, 576, generator=g).to(dt)
    packed = Weight(w, "isolab")
    out["gemm_" + name] = packed(x)
    # the same rows in slices of every size: a row's bits must not depend on M at any level
    out["gemm_m_mismatches_" + name] = sum(
        int((torch.cat([packed(x[s : s + m]) for s in range(0, 19, m)]) != out["gemm_" + name]).sum())
        for m in (1, 2, 3, 5, 9, 17))
    out["gemm_exact_" + name] = x.double() @ w.double().T
    hkv, heads, dh, bs, b, nb = 3, 9, 64, 16, 4, 6
    pool = torch.randn(2, hkv, b * nb + 1, bs, dh, generator=g).to(dt)
    tables = (torch.arange(b * nb, dtype=torch.int32) + 1).view(b, nb)
    q = torch.randn(b, heads, dh, generator=g).to(dt)
    pos = torch.tensor([5, 40, 77, 95], dtype=torch.int32)
    out["attention_" + name] = kernels.paged_attention(q, pool, tables, torch.arange(b, dtype=torch.int32), pos, 0.125)
    h = torch.randn(7, 576, generator=g).to(dt)
    out["rms_" + name] = kernels.rms_norm(h, torch.randn(576, generator=g).to(dt), 1e-5)
    out["silu_" + name] = kernels.silu_mul(torch.randn(7, 256, generator=g).to(dt))
    out["gemma_norm_" + name] = kernels.rms_norm_gemma(h, 1.0 + 0.1 * torch.randn(576, generator=g), 1e-6)
    out["attention_window_" + name] = kernels.paged_attention(q, pool, tables, torch.arange(b, dtype=torch.int32),
                                                             pos, 0.125, window=33)
    from isolab.kernels import quant as Q
    for fmt, fp16 in ((Q.U4, True), (Q.S8, True), (Q.S8G16, False)):  # quantized GEMMs: one chain everywhere
        u = Q.random_unpacked(fmt, 100, 576, fp16, seed=fmt)
        out[f"qgemm{fmt}_" + name] = kernels.qgemm(x, Q.pack(u), fmt, fp16, 100, dt)
torch.save(out, sys.argv[1])
"""


def _run_level(tmp_path, env_extra: dict[str, str], name: str) -> dict:
    target = tmp_path / f"{name}.pt"
    env = {**os.environ, **env_extra}
    res = subprocess.run([sys.executable, "-c", _LEVEL_SCRIPT, str(target)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return torch.load(target)


OWN_CHAINS = ("amx", "avx512bf16")  # bf16 GEMM chains other than the fma chain (isolab/kernels/gemm.cpp)


@pytest.mark.slow  # a subprocess (and a kernel build) per level: 6-30 s
def test_every_isa_level_gives_the_same_bits(tmp_path):
    """The kernels built for each level this CPU runs (generic SSE2 with software fma, AVX2+FMA,
    AVX-512, AVX-512 with AMX tiles, native): at every level a row's GEMM bits are the same at every
    M, and GEMM, attention and row ops give identical bits across the levels that share a chain.
    Two paths round otherwise by design and are compared only among themselves: bf16 GEMMs on AMX
    tiles or AVX512-BF16 dot products (other fixed summation orders, checked against the exact
    product instead) and bf16 attention on AMX tiles or AVX512-BF16 dot products."""
    levels = kernels.isa_levels()
    assert "generic" in levels and "native" in levels
    got = {lv: _run_level(tmp_path, {"ISOLAB_KERNEL_ISA": lv}, lv) for lv in levels}
    assert got["generic"]["isa"] == "generic"
    if "amx" in levels:
        assert got["amx"]["isa"] == "amx" and got["avx512"]["isa"] == "avx512"
    if "avx512bf16" in levels:  # a Zen's chains, on any CPU with the instructions (an AMX Xeon too)
        assert got["avx512bf16"]["isa"] == "avx512bf16" and got["avx512bf16"]["attention_isa"] == "avx512bf16"
    base = got["generic"]
    for lv, out in got.items():
        for name in ("bf16", "fp32"):
            assert out["gemm_m_mismatches_" + name] == 0, f"{lv}: {name} GEMM bits depend on M"
        if out["isa"] in OWN_CHAINS:  # its own chain: close to the exact product, equal among its builds
            exact = out["gemm_exact_bf16"]
            assert ((out["gemm_bf16"].double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-3).all()
            assert all(torch.equal(o["gemm_bf16"], out["gemm_bf16"]) for o in got.values() if o["isa"] == out["isa"])
        # bf16 attention: equal among the builds that take the same path (amx tiles, AVX512-BF16 dots)
        assert all(torch.equal(o["attention_bf16"], out["attention_bf16"]) for o in got.values()
                   if o["attention_isa"] == out["attention_isa"])
        # windowed calls never take AMX tiles: on an AMX build they take its dot-product or fma path,
        # which the AMX report does not name, so those are compared only where the report is the path
        if out["attention_isa"] != "amx":
            assert all(torch.equal(o["attention_window_bf16"], out["attention_window_bf16"]) for o in got.values()
                       if o["attention_isa"] == out["attention_isa"])
        for key, value in base.items():
            if not isinstance(value, torch.Tensor) or (key.startswith("attention") and key.endswith("bf16")
                                                       and out["bf16_dot"]) or \
                    (key == "gemm_bf16" and out["isa"] in OWN_CHAINS):
                continue
            assert torch.equal(out[key], value), f"{key} differs between generic and {lv} ({out['isa']})"


def test_a_level_the_cpu_lacks_is_refused_with_a_sentence(monkeypatch):
    monkeypatch.setenv("ISOLAB_KERNEL_ISA", "avx1024")
    with pytest.raises(kernels.BuildError, match="not a level"):
        kernels.isa_level()
    monkeypatch.setattr(kernels, "isa_levels", lambda: ["generic", "native"])
    monkeypatch.setenv("ISOLAB_KERNEL_ISA", "avx512")
    with pytest.raises(kernels.BuildError, match="lacks"):
        kernels.isa_level()


_CAP_SCRIPT = """
import json, sys, torch
from isolab.models import invariance
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
out = {}
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    r = invariance.choose(shapes, dt, torch.device("cpu"), (9, 3, 64), True)
    out[name] = {"invariant": r.invariant, "path": r.gemm_path, "rejected": list(r.rejected)}
print(json.dumps(out))
"""

ONEDNN_CAPS = {"AVX2": "avx2", "AVX512_CORE": "avx512f", "AVX512_CORE_BF16": "avx512_bf16",
               "AVX512_CORE_AMX": "amx_bf16"}


@pytest.mark.slow
def test_under_every_onednn_isa_cap_the_engine_runs_an_invariant_path(tmp_path):
    """ONEDNN_MAX_CPU_ISA at each level this CPU has: the start-up check (fresh cache) chooses a
    GEMM path that is invariant, in bf16 and fp32."""
    flags = kernels._cpu_flags()
    caps = [cap for cap, flag in ONEDNN_CAPS.items() if flag in flags]
    assert caps, "this CPU has not even AVX2"
    for cap in caps:
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap, "ISOLAB_INVARIANCE_CACHE": str(tmp_path / cap)}
        res = subprocess.run([sys.executable, "-c", _CAP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        for dname, r in out.items():
            assert r["invariant"], (cap, dname, r)


def test_a_batch_variant_gemm_is_detected_and_refused(tmp_path, monkeypatch, caplog):
    """The protection switched off: split-k (a reduction order that changes at M >= 8) fails the
    check, and the chooser refuses it for the next path, saying why."""
    monkeypatch.setenv("ISOLAB_INVARIANCE_CACHE", str(tmp_path))
    bad = invariance.check("split-k", [(96, 64)], torch.bfloat16, torch.device("cpu"), (4, 2, 64), True)
    assert not bad.gemm_ok and not bad.invariant
    per = bad.gemm_mismatches["96x64"]
    # against 512 rows in one call (split), the slices of fewer than 8 rows (not split) differ
    assert per["1"] > 0 and per["5"] > 0 and per["9"] == per["64"] == 0
    monkeypatch.setattr(invariance, "GEMM_PATHS", ("split-k", "isolab"))
    monkeypatch.setattr(invariance, "path_applies", lambda *a: True)
    chosen = invariance.choose([(96, 64)], torch.bfloat16, torch.device("cpu"), (4, 2, 64), True)
    assert chosen.gemm_path == "isolab" and chosen.invariant
    assert len(chosen.rejected) == 1 and "split-k" in chosen.rejected[0] and "NOT batch-invariant" in chosen.rejected[0]
    with caplog.at_level("WARNING", logger=invariance.log.name):
        forced = invariance.choose([(96, 64)], torch.bfloat16, torch.device("cpu"), (4, 2, 64), True, forced="split-k")
    assert forced.gemm_path == "split-k" and not forced.invariant
    # the fault forced it: the warning says so rather than blaming the machine (selftest printed that)
    assert "batch-variant-gemm fault" in caplog.text and "on this machine" not in caplog.text


def test_the_verdict_is_cached_per_machine_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("ISOLAB_INVARIANCE_CACHE", str(tmp_path))
    args = ([(64, 32)], torch.float32, torch.device("cpu"), (4, 2, 64), True)
    first = invariance.check("isolab", *args)
    again = invariance.check("isolab", *args)
    assert not first.cached and again.cached and again.gemm_mismatches == first.gemm_mismatches
    other = "AVX2" if os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2" else "AVX512_CORE"  # (the suite may run at AVX2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)  # another library configuration: checked anew
    assert not invariance.check("isolab", *args).cached
    assert not invariance.check("isolab", [(64, 34)], *args[1:]).cached


def test_the_attention_check_sees_a_batch_dependent_kernel(monkeypatch):
    """Attention whose output depends on the batch (a row's result scaled by the row count) fails."""
    real = kernels.paged_attention

    def leaky(q, *a, **k):
        return real(q, *a, **k) * (1 + 1e-2 * (q.shape[0] > 1))

    monkeypatch.setattr(invariance.kernels, "paged_attention", leaky)
    got = invariance.attention_mismatches(torch.float32, torch.device("cpu"), 4, 2, 64, native=True)
    assert got["batch_vs_solo"] > 0
