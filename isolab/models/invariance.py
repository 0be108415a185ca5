"""Owns the start-up check that the forward's numerics are batch-invariant on this machine.

Everything isolab proves about isolation compares a request's bits batched with its bits alone:
any difference is taken as contamination. That is only sound where each op gives a row the same
bits whatever else is in the call. So when an engine starts it measures it, on the model's own
shapes: every GEMM at M in CHECK_M (a row's bits in each slice against the same rows computed in
one call of MAX_M), and attention three ways (32 rows vs each alone, keys padded vs exact, a
40-query chunk vs one by one). A GEMM path that fails is refused and the next is tried
(models/linear.py: GEMM_PATHS); if none passes, the engine runs and says so.

The verdict is cached as JSON under the user cache dir, keyed by everything that shapes it: the
CPU (model and flags), torch's version, the kernel build, the ISA caps in the environment, the
device, dtype, path and shapes. So the check costs seconds once per machine and model shape.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from isolab import kernels
from isolab.kernels import quant
from isolab.models.attention import attention_core, gather_kv_i8, i8_pool_shape, write_kv, write_kv_i8
from isolab.models.linear import GEMM_PATHS, BlockWeight, GemmPath, QuantWeight, Weight, path_applies
from isolab.paths import user_cache

log = logging.getLogger(__name__)

CHECK_M = (1, 2, 3, 5, 9, 17, 32, 33, 64, 128, 512)
MAX_M = 512
MAX_M_WIDE = 128  # rows for a GEMM wider than WIDE columns (the vocabulary head): bounds the cost
WIDE = 16384
CHECK_VERSION = 4  # bump when the check itself changes: old verdicts are then not reused


@dataclass(frozen=True)
class InvarianceReport:
    """What the check found for one (device, dtype, GEMM path, attention path, shapes)."""

    invariant: bool  # every GEMM and attention case gave 0 differing outputs
    gemm_path: str  # models/linear.py: GemmPath
    attention: str  # "native" (isolab's paged kernel) or "torch" (attention_core)
    kernel_isa: str | None  # the native kernels' code path (gemm.cpp), None on the torch path
    cpu: str  # the CPU's model name and the flags that pick library kernels
    dtype: str
    gemm_mismatches: dict[str, dict[str, int]]  # "NxK" -> {M: differing outputs}
    attention_mismatches: dict[str, int]
    seconds: float  # what the check took when it ran (0 work when read from the cache)
    cached: bool = False
    rejected: tuple[str, ...] = ()  # paths tried before this one and why they were refused
    env: dict[str, str] = field(default_factory=dict)  # ONEDNN_MAX_CPU_ISA / ISOLAB_KERNEL_ISA if set
    attention_isa: str | None = None  # bf16 native attention's code path (kernels.attention_isa)
    kv_pool: str = "auto"  # "int8": the engine's pool is 8-bit, its attention checked too (with_kv_pool)
    # weights kept in GGUF blocks (kernels/qgemm.cpp): their GEMMs' mismatches are in gemm_mismatches
    # under "u4/fp16 960x576" keys; qgemm_isa: its integer path, "torch" for the reference
    quant_shapes: tuple[str, ...] = ()
    qgemm_isa: str | None = None
    dense_gemms: bool = True  # whether any GEMM runs dense (on gemm_path)
    # dense bf16 GEMMs whose weights stay in GGUF blocks (kernels/qdense.cpp), "u4/fp16 960x576": their
    # M check and their bits against the dense GEMM on the same weights ("dense" key) are in
    # gemm_mismatches under "blocks u4/fp16 960x576"; empty where they do not run
    block_shapes: tuple[str, ...] = ()

    @property
    def weights(self) -> str:
        """native: GEMMs on the GGUF's quantized blocks (every layer, or with some dense); dense."""
        return "native" if self.quant_shapes else "dense"

    @property
    def gemm_ok(self) -> bool:
        return all(v == 0 for per in self.gemm_mismatches.values() for v in per.values())

    @property
    def numerics(self) -> str:
        """One line for /health, logs and reports: e.g. 'isolab-gemm/amx + native/amx attention'."""
        g = f"{self.gemm_path}-gemm" + (f"/{self.kernel_isa}" if self.gemm_path == "isolab" and self.kernel_isa else "")
        if self.block_shapes:
            g += f" on {', '.join(sorted({s.split()[0] for s in self.block_shapes}))} blocks"
        if self.quant_shapes:
            q = f"q-gemm/{self.qgemm_isa} ({', '.join(sorted({s.split()[0] for s in self.quant_shapes}))})"
            g = f"{q} + {g}" if self.dense_gemms else q
        a = self.attention + (f"/{self.attention_isa}" if self.attention_isa else "")
        return f"{g} + {a} attention" + (f" over an {self.kv_pool} K/V pool" if self.kv_pool != "auto" else "")

    def summary(self) -> str:
        verdict = "batch-invariant" if self.invariant else "NOT batch-invariant"
        bad = [f"{s} at M={m}" for s, per in self.gemm_mismatches.items() for m, n in per.items() if n]
        bad += [k for k, n in self.attention_mismatches.items() if n]
        tail = f" (differs: {', '.join(bad[:4])}{'...' if len(bad) > 4 else ''})" if bad else ""
        return f"{verdict}: {self.numerics}, {self.dtype}, on {self.cpu.split(';')[0]}{tail}"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["numerics"] = self.numerics
        return d


def cpu_description() -> str:
    """'model name; flags that change library kernels' (AMX, AVX-512 BF16/VNNI, AVX-512, AVX2)."""
    model = ""
    flags: set[str] = set()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name") and not model:
                model = ln.split(":", 1)[1].strip()
            elif ln.startswith("flags") and not flags:
                flags = set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    keep = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma")
    return f"{model or 'unknown CPU'}; {' '.join(f for f in keep if f in flags) or 'no AVX2'}"


def cache_root() -> Path:
    """Where this kind of cache lives (isolab cache lists and clears it)."""
    if os.environ.get("ISOLAB_INVARIANCE_CACHE"):
        return Path(os.environ["ISOLAB_INVARIANCE_CACHE"])
    return user_cache("invariance")


def _env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ISOLAB_KERNEL_ISA") if os.environ.get(k)}


def gemm_mismatches(fn, n: int, k: int, dtype: torch.dtype, device: torch.device,
                    ms: tuple[int, ...] = CHECK_M) -> dict[str, int]:
    """fn(x (M, K)) -> (M, n), the GEMM under test with its weight bound. Rows computed in one call
    of MAX_M rows against the same rows in slices of M (at the start and at the end of the block);
    returns {M: differing outputs}."""
    g = torch.Generator().manual_seed(n * 7919 + k)
    rows = MAX_M if n <= WIDE else MAX_M_WIDE
    x = torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)
    ref = fn(x)
    out: dict[str, int] = {}
    for m in ms:
        if m > rows:
            continue
        bad = 0
        for s in sorted({0, rows - m, (rows // 2) // m * m}):
            bad += int((fn(x[s : s + m]) != ref[s : s + m]).sum())
        out[str(m)] = bad
    return out


def attention_mismatches(dtype: torch.dtype, device: torch.device, heads: int, hkv: int, dh: int,
                         native: bool, bs: int = 16, kv_pool: str = "auto") -> dict[str, int]:
    """Attention on the same queries and keys grouped three ways: 32 decode rows at once vs each
    alone, keys covered exactly vs padded to whole blocks, and a 70-query prompt in one chunk vs
    cut into chunks of 1, 2, 3, 5, 9, 17, 32 and 33 queries, each over its own table's width (what
    preemption, token budgets and prefix hits rely on). `native`: isolab's kernel reading a
    paged pool; else attention_core over gathered keys (the torch path). kv_pool "int8": over the
    8-bit pool (the torch path: over its dequantized keys)."""
    g = torch.Generator().manual_seed(0)
    b, s = 32, 10 * bs
    q = torch.randn(b, 1, heads, dh, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(hkv, b, s, dh, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(hkv, b, s, dh, generator=g).to(device=device, dtype=dtype)
    pos = torch.randint(s // 4, s - 10, (b, 1), generator=g).to(device)
    # the same keys in a pool (bf16/fp32 or the 8-bit one): row i's table is blocks i*nb+1 .. (i+1)*nb
    nb = s // bs
    slots = torch.arange(bs, (b * nb + 1) * bs, device=device)
    kk, vv = k.permute(1, 2, 0, 3).reshape(-1, hkv, dh), v.permute(1, 2, 0, 3).reshape(-1, hkv, dh)
    tables = (torch.arange(b * nb, dtype=torch.int32, device=device) + 1).view(b, nb)
    if kv_pool == "int8":
        pool = torch.zeros(i8_pool_shape(hkv, b * nb + 1, bs, dh), dtype=torch.int8, device=device)
        write_kv_i8(pool, slots, kk, vv)
        if not native:  # the torch path attends over the pool's dequantized values
            k, v = gather_kv_i8(pool, tables.long(), dtype)
    elif native:
        pool = torch.zeros(2, hkv, b * nb + 1, bs, dh, dtype=dtype, device=device)
        write_kv(pool, slots, kk, vv)

    if native:
        def attend(qs, rows, p, width):
            t = tables[rows][:, : -(-width // bs)].contiguous()
            row_table = torch.arange(len(rows), dtype=torch.int32, device=device).repeat_interleave(qs.shape[1])
            out = kernels.paged_attention(qs.reshape(-1, heads, dh), pool, t, row_table,
                                          p.reshape(-1).to(torch.int32), dh**-0.5)
            return out.view(qs.shape)
    else:
        def attend(qs, rows, p, width):
            return attention_core(qs, k[:, rows, :width], v[:, rows, :width], p, dh**-0.5)

    # 32 decode rows in one call: only the native kernel runs them so (the torch path gives each
    # chunk, decode rows too, a call of its own: model_runner._torch_groups)
    full = attend(q, list(range(b)), pos, s)
    batch = padded = 0
    for i in range(b):
        one = slice(i, i + 1)
        if native:
            batch += int((attend(q[one], [i], pos[one], s) != full[one]).sum())
        else:
            full[one] = attend(q[one], [i], pos[one], s)
        width = -(-(int(pos[i]) + 1) // bs) * bs
        padded += int((attend(q[one], [i], pos[one], width) != full[one]).sum())
    # a prompt as one chunk vs cut into chunks of each size, as the engine would run them (after a
    # prefix hit, preemption or a token budget): each chunk over its own table's whole blocks
    t = min(70, s - bs)
    qq = torch.randn(1, t, heads, dh, generator=g).to(device=device, dtype=dtype)
    tpos = torch.arange(t, device=device).view(1, t)
    chunk = attend(qq, [0], tpos, -(-t // bs) * bs)
    split = 0
    for size in (1, 2, 3, 5, 9, 17, 32, 33):
        for j in range(0, t, size):
            e = min(t, j + size)
            split += int((attend(qq[:, j:e], [0], tpos[:, j:e], -(-e // bs) * bs) != chunk[:, j:e]).sum())
    found = {"batch_vs_solo": batch} if native else {}
    return {**found, "padded_vs_exact": padded, "chunk_vs_split": split}


def with_kv_pool(report: InvarianceReport, kv_pool: str, device: torch.device, heads: tuple[int, int, int],
                 native: bool) -> InvarianceReport:
    """The report of an engine whose K/V pool is `kv_pool`: for "int8", attention over the 8-bit pool
    checked the same three ways (once a process for each shape: 1.6 s for SmolLM2's on the AMX
    Xeon, timed by hand) and folded into the verdict; "auto": the report as it is."""
    if kv_pool == "auto":
        return report
    found = _pool_mismatches(kv_pool, report.dtype, str(device), heads, native)
    report = dataclasses.replace(
        report, kv_pool=kv_pool, invariant=report.invariant and not any(found.values()),
        attention_mismatches={**report.attention_mismatches, **{f"{kv_pool} pool {k}": n for k, n in found.items()}})
    if any(found.values()):
        _log(report)
    return report


@functools.lru_cache(maxsize=16)
def _pool_mismatches(kv_pool: str, dtype: str, device: str, heads: tuple[int, int, int], native: bool) -> dict[str, int]:
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    return attention_mismatches(tdtype, torch.device(device), *heads, native, kv_pool=kv_pool)


def _key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def check(path: GemmPath, shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
          heads: tuple[int, int, int], native_attention: bool, *, use_cache: bool = True,
          quant_shapes: list[tuple[str, int, int]] = (), quant_native: bool = False,  # type: ignore[assignment]
          block_shapes: list[tuple[str, int, int]] = ()) -> InvarianceReport:  # type: ignore[assignment]
    """Measure one GEMM path on `shapes` [(N, K)], the quantized GEMM on `quant_shapes` [(format
    label, N, K)] (qgemm.cpp where quant_native, else its torch reference) and the attention path
    on heads (H, Hkv, Dh). block_shapes [(format label, N, K)]: dense GEMMs that can run on their
    GGUF blocks (qdense.cpp); checked on the isolab path only (other paths do not run them), for
    M-invariance and for the dense GEMM's bits on the same weights."""
    block_shapes = sorted(set(block_shapes)) if path == "isolab" and dtype == torch.bfloat16 else []
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    kernel_isa = kernels.gemm_isa() if native_attention or path == "isolab" else None
    qisa = (kernels.qgemm_isa() if quant_native else "torch") if quant_shapes else None
    parts = {
        "v": CHECK_VERSION, "cpu": cpu_description(), "torch": torch.__version__, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "kernels": kernels.build_key() if kernel_isa else "", "env": _env(), "dtype": dname, "path": path,
        "shapes": sorted(shapes), "heads": list(heads), "attention": native_attention,
        "threads": torch.get_num_threads(), "quant": [list(q) for q in sorted(quant_shapes)], "qisa": qisa,
    }
    if block_shapes:  # (absent otherwise, so verdicts from before the blocks stay valid)
        parts["blocks"] = [list(b) for b in block_shapes]
    target = cache_root() / f"{_key(parts)}.json"
    if use_cache and target.exists():
        try:
            data = json.loads(target.read_text())
            data.pop("numerics", None)
            data["rejected"] = tuple(data.get("rejected", ()))
            data["quant_shapes"] = tuple(data.get("quant_shapes", ()))
            data["block_shapes"] = tuple(data.get("block_shapes", ()))
            return InvarianceReport(**{**data, "cached": True})
        except (OSError, ValueError, TypeError):
            pass  # a damaged entry is measured again
    t0 = time.perf_counter()
    gm: dict[str, dict[str, int]] = {}
    with torch.inference_mode():
        for n, k in sorted(set(shapes)):
            w = Weight(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(device=device, dtype=dtype),
                       path)
            gm[f"{n}x{k}"] = gemm_mismatches(w, n, k, dtype, device)
        for label, n, k in sorted(set(quant_shapes)):
            fmt = next(f for f, name in quant.FORMAT_NAMES.items() if label.startswith(name + "/"))
            # (the split-k path, FAULT batch-variant-gemm, reaches the quantized GEMMs too: so does its check)
            qw = QuantWeight(quant.random_unpacked(fmt, n, k, label.endswith("fp16"), seed=n + k), device, quant_native,
                             split_k=path == "split-k")
            gm[f"{label} {n}x{k}"] = gemm_mismatches(qw, n, k, dtype, device)
        for label, n, k in block_shapes:
            fmt = next(f for f, name in quant.FORMAT_NAMES.items() if label.startswith(name + "/"))
            u = quant.random_unpacked(fmt, n, k, label.endswith("fp16"), seed=n + k)
            bw = BlockWeight.from_unpacked(u)
            per = gemm_mismatches(bw, n, k, dtype, device)
            x = torch.randn(min(n, 64), k, generator=torch.Generator().manual_seed(n + k)).to(dtype)
            values = quant.dequantize_rows(quant.pack(u), fmt, label.endswith("fp16"), np.arange(n), k)  # the GGUF's
            per["dense"] = int((bw(x) != Weight(torch.from_numpy(values).to(dtype), path)(x)).sum())
            gm[f"blocks {label} {n}x{k}"] = per
        am = attention_mismatches(dtype, device, *heads, native=native_attention)
    ok = all(v == 0 for per in gm.values() for v in per.values()) and all(v == 0 for v in am.values())
    report = InvarianceReport(
        invariant=ok, gemm_path=path, attention="native" if native_attention else "torch", kernel_isa=kernel_isa,
        cpu=cpu_description(), dtype=dname, gemm_mismatches=gm, attention_mismatches=am,
        seconds=round(time.perf_counter() - t0, 3), env=_env(),
        attention_isa=kernels.attention_isa() if native_attention and dname == "bf16" else None,
        quant_shapes=tuple(f"{label} {n}x{k}" for label, n, k in sorted(set(quant_shapes))), qgemm_isa=qisa,
        dense_gemms=bool(shapes), block_shapes=tuple(f"{label} {n}x{k}" for label, n, k in block_shapes),
    )
    if use_cache:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dataclasses.asdict(report), indent=1))
            os.replace(tmp, target)
        except OSError as exc:  # a read-only home still runs, it just checks again next time
            log.warning("could not cache the invariance check: %s", exc)
    return report


def choose(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device, heads: tuple[int, int, int],
           native: bool, forced: GemmPath | None = None, quant_shapes: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
           quant_native: bool = False, block_shapes: list[tuple[str, int, int]] = ()) -> InvarianceReport:  # type: ignore[assignment]
    """The first GEMM path (models/linear.py: GEMM_PATHS) that applies here and whose GEMMs pass the
    check, with its report (whose verdict covers attention too: no GEMM path mends attention). `forced`: check that path only and keep it whatever the verdict (the
    --gemm option, and the batch-variant-gemm fault). None passing: the first that applies, with
    invariant=False and a warning."""
    candidates = [forced] if forced else [p for p in GEMM_PATHS if path_applies(p, device, dtype, native)]
    rejected: list[str] = []
    first: InvarianceReport | None = None
    for path in candidates:
        report = check(path, shapes, dtype, device, heads, native, quant_shapes=quant_shapes, quant_native=quant_native,
                       block_shapes=block_shapes)
        if report.block_shapes and not report.gemm_ok and _only_blocks_differ(report):
            # the dense GEMM on GGUF blocks failed where the same path's panels may not: the model
            # keeps its panels (a verdict without block_shapes) rather than losing the whole path
            rejected.append(f"{report.summary()}; GEMMs on GGUF blocks refused, the path kept with bf16 panels")
            report = check(path, shapes, dtype, device, heads, native, quant_shapes=quant_shapes,
                           quant_native=quant_native)
        first = first or report
        if report.gemm_ok or forced:
            report = dataclasses.replace(report, rejected=tuple(rejected))
            _log(report)
            return report
        rejected.append(report.summary())
    assert first is not None
    report = dataclasses.replace(first, rejected=tuple(rejected))
    _log(report)
    return report


def _only_blocks_differ(report: InvarianceReport) -> bool:
    """Whether every differing GEMM output of `report` is in a GEMM on GGUF blocks (qdense.cpp)."""
    return all(s.startswith("blocks ") for s, per in report.gemm_mismatches.items() if any(per.values()))


def _log(report: InvarianceReport) -> None:
    for line in report.rejected:
        log.warning("%s: %s", "GEMM on GGUF blocks refused" if line.endswith("bf16 panels") else "GEMM path refused", line)
    if report.invariant:
        log.info("numerics %s (%s)", report.summary(), "cached" if report.cached else f"checked in {report.seconds:.1f} s")
    elif report.gemm_path == "split-k":  # asked for: the machine is not to blame
        log.warning("numerics %s: the batch-variant-gemm fault makes batched and solo outputs differ, as it is "
                    "meant to", report.summary())
    else:
        log.warning("numerics %s: batched and solo outputs can differ, so isolation checks that compare "
                    "them are not conclusive on this machine", report.summary())
