"""Owns isolab's native kernels: the GEMM on packed weights, paged attention that reads K/V
straight from the pool, and the fused per-row ops around it (RMSNorm, residual add + RMSNorm,
RoPE, SiLU * up).

Built on first use with the system C++ compiler into ~/.cache/isolab/kernels (keyed by the
source, the flags, the compiler and the CPU), loaded with ctypes, and run on torch's own OpenMP
threads (the .so links the libgomp that torch has already loaded). Where they cannot be built
(no C++ compiler, not Linux) or do not apply (a GPU device), `available()` is False and the model
runs its torch path (`LlamaModel.forward`'s torch ops and `attention_core`); `ISOLAB_NATIVE=0`
forces that path.

ISA levels: the build targets this CPU (`native`);
`ISOLAB_KERNEL_ISA=generic|avx2|avx512|avx512bf16|amx` builds for a lower level instead (x86-64,
x86-64-v3, x86-64-v4, x86-64-v4 with BF16 dot products and VNNI as AMD Zen 4/5 run it, x86-64-v4
with AMX tiles), so tests can run every code path this CPU can execute. A level the CPU lacks is
refused with a sentence.

Every kernel computes each output element in an order fixed by that element's row alone, which is
what makes the engine's results independent of the batch in fp32 as well as bf16. The GEMM goes
further: its per-element fma chain is the same on every ISA level, so its bits are the same on
every x86 CPU without AMX (gemm.cpp); where AMX runs, bf16 GEMMs take the tile unit at every M,
another fixed chain with its own bits.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from isolab.errors import InvalidRequestError
from isolab.paths import user_cache

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("paged_attention.cpp", "pointwise.cpp", "gemm.cpp", "qgemm.cpp",
                                                      "qdense.cpp", "forward.cpp"))
# the kernels' run-time settings (isolab_<name>(int)): none changes a bit, each is for an A/B or a test
SETTINGS = ("attention_fast_paths", "attention_row_units", "attention_prefetch", "balance", "qgemm_order",
            "qgemm_tile_rows")
HEADERS = tuple(Path(__file__).with_name(n) for n in ("simd.h", "balance.h", "records.h"))
# -ffp-contract=off: no silent fma, so every ISA level rounds alike. -mtune=generic: `native` takes
# this CPU's instructions but the same tuning as the x86-64-vN levels; GCC 12 tunes an AMX Xeon as
# "rocketlake", which made the quantized GEMM's VNNI path 1.38x slower than an x86-64-v4 build of the
# same source (4.13 against 2.98 ms, timed by hand; -mtune=generic alone gave it back). Tuning
# changes no bit.
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off", "-mtune=generic")
# ISA level -> (-march flag, the /proc/cpuinfo flags it needs)
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "generic": (("-march=x86-64",), ()),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi2")),
    "avx512": (("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    # what AMD Zen 4/5 run: AVX-512 with BF16 dot products and VNNI, no AMX
    "avx512bf16": (("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
                   ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni")),
    "amx": (("-march=x86-64-v4", "-mamx-tile", "-mamx-bf16"), ("avx512f", "avx512bw", "avx512dq", "avx512vl",
                                                              "amx_tile", "amx_bf16")),
    "native": (("-march=native",), ()),
}
GEMM_PAD_N = 32  # packed weights have N padded to this (the widest tile of any ISA level)
MAX_GROUP = 8  # query heads per KV head the kernel's stack buffers hold
MAX_HEAD_DIM = 256
FAST_BLOCK_SIZE = 16  # paged_attention.cpp's fast paths take K/V blocks of a multiple of this (every dtype and head size)


def cache_root() -> Path:
    """Where this kind of cache lives (isolab cache lists and clears it)."""
    return user_cache("kernels")


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for ln in text.splitlines():
        if ln.startswith("flags"):
            return set(ln.split(":", 1)[1].split())
    return set()


def isa_levels() -> list[str]:
    """The ISA levels this CPU can run, lowest first (x86-64 only; elsewhere just native)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    flags = _cpu_flags()
    return [name for name, (_, need) in ISA_LEVELS.items() if all(f in flags for f in need)]


def isa_level() -> str:
    """The level the kernels are built for: ISOLAB_KERNEL_ISA, default native."""
    level = os.environ.get("ISOLAB_KERNEL_ISA", "native") or "native"
    if level not in ISA_LEVELS:
        raise BuildError(f"ISOLAB_KERNEL_ISA={level!r} is not a level; choose one of {', '.join(ISA_LEVELS)}")
    if level not in isa_levels():
        raise BuildError(f"ISOLAB_KERNEL_ISA={level} needs CPU features this CPU lacks; it runs: {', '.join(isa_levels())}")
    return level


BUILD_TMP_PREFIX = "isolab-kernels-tmp-"  # a build's folder in the cache until its .so is renamed in
_loaded_from: list[Path] = []  # the .so _library loaded (the cache's, or a private build's)


def cache_unwritable(exc: OSError) -> bool:
    """Whether a build's OSError is the cache folder's: about it, inside it, or about a folder above
    it (a fresh read-only home fails on ~/.cache or ~/.cache/isolab, which mkdir makes first)."""
    if exc.filename is None:
        return False
    at, root = Path(str(exc.filename)), cache_root()
    return at.is_relative_to(root) or root.is_relative_to(at)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ISOLAB_NATIVE", "1") == "0":
        return None
    try:
        level = isa_level()
    except BuildError as exc:  # the user's ISOLAB_KERNEL_ISA: one sentence, not kernels silently off
        raise InvalidRequestError(str(exc), field="ISOLAB_KERNEL_ISA") from None
    try:
        try:
            target = build(isa=level)
        except OSError as exc:  # the cache cannot be written (a read-only home): build for this process alone
            if not cache_unwritable(exc):
                raise
            log.warning("the kernels' cache %s cannot be written (%s): building them for this process only",
                        cache_root(), exc.strerror)
            private = Path(tempfile.mkdtemp(prefix="isolab-kernels-"))
            atexit.register(shutil.rmtree, private, True)  # a loaded .so needs no file
            target = build(isa=level, cache_dir=private)
    except (OSError, subprocess.SubprocessError, BuildError) as exc:
        log.warning("native kernels unavailable, using the torch path (slower): %s", exc)
        return None
    _loaded_from.append(target)
    lib = ctypes.CDLL(str(target))
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    signatures = {
        "paged_attention": [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr, i32, i32, i32, i64, i32, i32,
                            f32, i32],
        "paged_attention_i8": [ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, ptr, ptr, i32, i32, i32, i64, i32, i32,
                               f32, i32],
        "rms_norm": [ptr, ptr, ptr, i32, i32, f32],
        "rms_norm_gemma": [ptr, ptr, ptr, i32, i32, f32],
        "add_rms_norm": [ptr, ptr, ptr, ptr, i32, i32, f32],
        "silu_mul": [ptr, ptr, i32, i32],
        "rope": [ptr, ptr, ptr, ptr, i32, i32, i32, i32],
        "gemm": [ptr, i64, ptr, ptr, i32, i32, i32],
        "argmax_rows": [ptr, i64, i32, i32, ptr],
    }
    for name, args in signatures.items():
        for suffix in ("bf16", "fp32"):
            fn = getattr(lib, f"isolab_{name}_{suffix}")
            fn.restype = None
            fn.argtypes = args
    lib.isolab_qgemm.restype = None
    lib.isolab_qgemm.argtypes = [ptr, i32, i64, ptr, i32, i32, ptr, i32, i32, i32, i32]
    lib.isolab_qdense.restype = None
    lib.isolab_qdense.argtypes = [ptr, i64, ptr, i32, i32, ptr, i32, i32, i32]
    lib.isolab_qdense_record.restype = None
    lib.isolab_qdense_record.argtypes = [ptr, i32, i32, ptr, i32]
    lib.isolab_qdense_isa.restype = ctypes.c_char_p
    lib.isolab_qdense_isa.argtypes = []
    lib.isolab_quantize_rows.restype = None
    lib.isolab_quantize_rows.argtypes = [ptr, i32, i64, i32, i32, ptr, ptr, ptr]
    for suffix in ("bf16", "fp32"):
        fn = getattr(lib, f"isolab_forward_{suffix}")
        fn.restype = None
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, ptr, ptr, i32, i32, i32, i32,
                       i32, i64, i32, f32, f32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.isolab_forward_layer_size.restype = i64
    lib.isolab_forward_profile.restype = None
    lib.isolab_forward_profile.argtypes = [i32]
    lib.isolab_forward_profile_read.restype = i32
    lib.isolab_forward_profile_read.argtypes = [ptr, i32]
    if lib.isolab_forward_layer_size() != ctypes.sizeof(FusedLayer):
        raise BuildError("forward.cpp's Layer and kernels.FusedLayer disagree")
    lib.isolab_qgemm_isa.restype = ctypes.c_char_p
    lib.isolab_qgemm_isa.argtypes = []
    lib.isolab_gemm_isa.restype = ctypes.c_char_p
    lib.isolab_gemm_isa.argtypes = []
    for name in SETTINGS:  # the kernels' run-time settings: one int each, nothing returned
        fn = getattr(lib, f"isolab_{name}")
        fn.restype = None
        fn.argtypes = [i32]
    lib.isolab_attention_bf16_dot.restype = i32
    lib.isolab_attention_bf16_dot.argtypes = []
    lib.isolab_attention_isa.restype = ctypes.c_char_p
    lib.isolab_attention_isa.argtypes = []
    lib.isolab_qgemm_default_tile_rows.restype = i32
    lib.isolab_qgemm_default_tile_rows.argtypes = []
    return lib


def _set(name: str, value: int) -> bool:
    """Set one of SETTINGS; False without the native kernels."""
    lib = _library()
    if lib is None:
        return False
    getattr(lib, f"isolab_{name}")(int(value))
    return True


def attention_fast_paths(on: bool) -> None:
    """Let rows with bs = 16, Dh = 64 take the vectorized kernels (default), or send every row
    through the generic one (tests compare them)."""
    ok = _set("attention_fast_paths", on)
    assert ok, "attention_fast_paths needs the native kernels"


def attention_row_units(on: bool) -> bool:
    """bf16 rows of a prompt chunk, four consecutive positions of one table at a time, in one pass
    over their keys (paged_attention.cpp, attend_rows_bf16; the default), or every row alone: for
    the bench's A/B and the tests. No bit changes. False where the kernels are not built."""
    return _set("attention_row_units", on)


def attention_prefetch(level: int) -> bool:
    """Set what the bf16 attention kernels prefetch (paged_attention.cpp: 0 nothing, 1 within a task,
    2 also the next task, the default; the AMX kernel and the fma kernel's bf16 path (64-dim heads)
    have no next-task prefetch, so 1 and 2 are the same there: paged_attention.cpp says why); no level
    changes a bit. False without the native kernels."""
    return _library() is not None and _set("attention_prefetch", level)


def balance(on: bool, *, late_first_thread: bool = False) -> bool:
    """Let the quantized GEMM's threads take the tasks another thread has not started (balance.h;
    the default), or keep each to its static share (the bench's A/B); `late_first_thread` holds
    thread 0 back 2 ms a call so the others take its tasks (a test). No setting changes a bit.
    False without the native kernels."""
    return _set("balance", 2 if on and late_first_thread else int(on))


def qgemm_order(on: bool) -> bool:
    """The quantized GEMM's task order for weights larger than its quantized activations (group by
    group, so they stream from memory once) and its prefetch of the next task's panels (the
    default), or chunk by chunk with no prefetch (the bench's A/B). No setting changes a bit.
    False without the native kernels."""
    return _set("qgemm_order", on)


def qgemm_tile_rows(rows: int = 0) -> bool:
    """Rows per tile of the quantized GEMM: at most 8 on AVX-512 VNNI, 4 on AVX2 and plain C; 0: the
    build's default (qgemm_default_tile_rows). For the bench's A/B (bench/qgemm.py --tiles-ab). No
    setting changes a bit. False without the native kernels."""
    return _set("qgemm_tile_rows", rows)


def qgemm_default_tile_rows() -> int:
    """The quantized GEMM's rows per tile unless set: 8 on AVX-512 VNNI, 3 on AVX2 (4 rows' sums spill
    its 16 registers), 4 in plain C; 0 without the native kernels."""
    lib = _library()
    return 0 if lib is None else int(lib.isolab_qgemm_default_tile_rows())


def attention_bf16_dot() -> bool:
    """Whether bf16 attention uses bf16 dot products, on AMX tiles or AVX512-BF16 (other rounding
    than the generic path)."""
    lib = _library()
    return lib is not None and bool(lib.isolab_attention_bf16_dot())


def attention_isa() -> str:
    """Which code path bf16 attention runs: amx (tiles: a unit of up to 16 (row, head) queries of
    one table per instruction), avx512bf16 (dot products, a row at a time) or fma (fp32
    arithmetic, as fp32 attention does); "torch" where the native kernels are unavailable."""
    lib = _library()
    return "torch" if lib is None else lib.isolab_attention_isa().decode()


def gemm_isa() -> str:
    """Which code path the bf16 GEMM runs: amx (the tile unit, for K % 32 == 0), avx512, avx2 or
    generic (fp32, and bf16 on other K, take the fma chain of the level the build targets)."""
    lib = _library()
    assert lib is not None
    return lib.isolab_gemm_isa().decode()


_FNS: dict[tuple[str, torch.dtype], object] = {}


def _fn(name: str, dtype: torch.dtype):  # the bf16 or fp32 entry point (looked up once: calls are hot)
    fn = _FNS.get((name, dtype))
    if fn is None:
        lib = _library()
        assert lib is not None
        fn = _FNS[(name, dtype)] = getattr(lib, f"isolab_{name}_{'bf16' if dtype == torch.bfloat16 else 'fp32'}")
    return fn


class BuildError(RuntimeError):
    pass


def build_target(cxx: str | None = None, cache_dir: Path | None = None, isa: str = "native") -> tuple[Path, str, tuple[str, ...]]:
    """Where build() puts the kernels of this source, ISA level, compiler and CPU (the .so's name is
    their hash), with the compiler and flags it uses; nothing is compiled (isolab cache names the
    others stale). BuildError without a compiler."""
    found = shutil.which(cxx or os.environ.get("CXX", "g++"))
    if found is None or platform.system() != "Linux":
        raise BuildError(f"no C++ compiler ({cxx or os.environ.get('CXX', 'g++')}) on {platform.system()}")
    flags = (*FLAGS, *ISA_LEVELS[isa][0])
    src = b"\0".join(p.read_bytes() for p in SOURCES + HEADERS)
    version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(), _cpu_id().encode()])).hexdigest()[:16]
    return (cache_dir or cache_root()) / f"isolab-kernels-{key}.so", found, flags


def build(cxx: str | None = None, cache_dir: Path | None = None, isa: str = "native") -> Path:
    """Compile the kernels (once per source, flags, ISA level, compiler and CPU) and return the .so path."""
    target, found, flags = build_target(cxx, cache_dir, isa)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=BUILD_TMP_PREFIX) as tmp:
        out = Path(tmp) / target.name
        res = subprocess.run([found, *flags, *map(str, SOURCES), "-o", str(out)], capture_output=True, text=True,
                             timeout=600)
        if res.returncode != 0:
            raise BuildError(f"{found} failed: {res.stderr.strip()[-800:]}")
        os.replace(out, target)  # atomic: concurrent builders each land a whole file
    return target


def available(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and _library() is not None)


def paged_attention(
    q: torch.Tensor,  # (N, H, Dh) queries, one per row
    kv: torch.Tensor,  # (2, Hkv, num_blocks, bs, Dh) one layer's pool, blocks as attention.write_kv lays them
    tables: torch.Tensor,  # (R, table_len) int32 block tables
    row_table: torch.Tensor,  # (N,) int32: which table each row reads
    q_pos: torch.Tensor,  # (N,) int32: row n attends to keys 0..q_pos[n], all inside its table
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # k, v (N, Hkv, Dh), slots (N,) int64
    window: int = 0,  # > 0: row n sees only keys q_pos[n] - window + 1 .. q_pos[n] (a sliding window)
) -> torch.Tensor:  # (N, H, Dh)
    """Write this step's K/V (if given) into the pool, then attend: one native call.

    q, k and v may be row views of one (N, W) buffer (the qkv GEMM's output): they must share the
    row stride and have each head's Dh values contiguous. An int8 pool (kv_cache_dtype "int8") is
    (Hkv, num_blocks, bs / 16, 2, 16 * (Dh + 4)), models/attention.py:i8_pool_shape."""
    N, H, Dh = q.shape
    i8 = kv.dtype == torch.int8
    if i8:
        hkv, nb, runs, _, run_bytes = kv.shape
        bs = runs * 16
        assert Dh % 16 == 0 and run_bytes == 16 * (Dh + 4), "an int8 pool of this head size (i8_pool_shape)"
    else:
        _, hkv, nb, bs, _ = kv.shape
    assert kv.is_contiguous() and (i8 or q.dtype == kv.dtype) and q.stride(2) == 1 and q.stride(1) == Dh
    assert tables.dtype == row_table.dtype == q_pos.dtype == torch.int32 and tables.is_contiguous()
    k_ptr = v_ptr = slots_ptr = None
    if new_kv is not None:
        k, v, slots = new_kv
        assert k.stride()[1:] == v.stride()[1:] == (Dh, 1) and slots.dtype == torch.int64
        assert N == 1 or k.stride(0) == v.stride(0) == q.stride(0), "q, k, v must share a row stride"
        assert slots.is_contiguous() and k.dtype == v.dtype == q.dtype
        k_ptr, v_ptr, slots_ptr = k.data_ptr(), v.data_ptr(), slots.data_ptr()
    out = torch.empty(N, H, Dh, dtype=q.dtype, device=q.device)
    if i8:
        _fn("paged_attention_i8", q.dtype)(q.data_ptr(), k_ptr, v_ptr, q.stride(0), slots_ptr, kv.data_ptr(),
                                           tables.data_ptr(), tables.shape[1], row_table.data_ptr(), q_pos.data_ptr(),
                                           out.data_ptr(), N, H, hkv, nb, bs, Dh, scale, window)
        return out
    _fn("paged_attention", q.dtype)(q.data_ptr(), k_ptr, v_ptr, q.stride(0), slots_ptr, kv[0].data_ptr(),
                                    kv[1].data_ptr(), tables.data_ptr(), tables.shape[1], row_table.data_ptr(),
                                    q_pos.data_ptr(), out.data_ptr(), N, H, hkv, nb, bs, Dh, scale, window)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(N, D) -> (N, D): weight * round(x * rsqrt(mean(x^2) + eps))."""
    assert x.is_contiguous() and x.dtype == weight.dtype
    out = torch.empty_like(x)
    _fn("rms_norm", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(N, D) -> (N, D): round(x * rsqrt(mean(x^2) + eps) * weight) in fp32; weight fp32 (Gemma's 1 + w)."""
    assert x.is_contiguous() and weight.dtype == torch.float32 and weight.is_contiguous()
    out = torch.empty_like(x)
    _fn("rms_norm_gemma", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (the residual stream), then return rms_norm(x): (N, D) -> (N, D)."""
    assert x.is_contiguous() and delta.is_contiguous() and x.dtype == delta.dtype == weight.dtype
    out = torch.empty_like(x)
    _fn("add_rms_norm", x.dtype)(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                 x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2I) -> (N, I): silu(gate) * up."""
    assert gate_up.is_contiguous()
    n, two_i = gate_up.shape
    out = torch.empty(n, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), n, two_i // 2)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """(M, V) bf16 or fp32 -> (M,) int64: torch.argmax(x, dim=-1), the same answer (first NaN, else
    the first maximum), each row on its own; torch's own is several times slower on the vocabulary."""
    M, V = x.shape
    assert x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1 and V > 0
    out = torch.empty(M, dtype=torch.int64)
    _fn("argmax_rows", x.dtype)(x.data_ptr(), x.stride(0), M, V, out.data_ptr())
    return out


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate the first `heads` heads of each row of qkv (N, W) in place; cos, sin: (P, Dh) tables."""
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and positions.dtype == torch.int64
    positions = positions.contiguous()
    _fn("rope", qkv.dtype)(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                           qkv.shape[0], heads, qkv.shape[1], head_dim)


@functools.lru_cache(maxsize=1)
def build_key() -> str:
    """The loaded kernel build (its file name carries the hash of sources, flags, compiler and CPU)."""
    build_path = _loaded_from[0] if _library() is not None and _loaded_from else build(isa=isa_level())
    return build_path.stem


def packed_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape pack_weight gives an (n, k) weight of this dtype."""
    n_pad = -(-n // GEMM_PAD_N) * GEMM_PAD_N
    return (n_pad // 16, k // 2, 16, 2) if dtype == torch.bfloat16 else (n_pad // 16, k, 16)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 or fp32 -> the GEMM's packed panels (gemm.cpp), N padded to GEMM_PAD_N:
    fp32 (Np/16, K, 16); bf16 (Np/16, K/2, 16, 2). bf16 needs an even K."""
    n, k = w.shape
    assert w.dtype in (torch.bfloat16, torch.float32) and (w.dtype == torch.float32 or k % 2 == 0)
    n_pad = -(-n // GEMM_PAD_N) * GEMM_PAD_N
    wp = torch.zeros(n_pad, k, dtype=w.dtype, device=w.device)
    wp[:n] = w
    if w.dtype == torch.bfloat16:
        out = wp.view(n_pad // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        out = wp.view(n_pad // 16, 16, k).permute(0, 2, 1).contiguous()
    assert tuple(out.shape) == packed_shape(n, k, w.dtype)
    return out


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x (M, K) @ W.T -> (M, n), W packed by pack_weight. Each output element is one fma chain over
    k in order, so a row's bits depend on nothing but the row and W (gemm.cpp)."""
    m, k = x.shape
    assert x.dtype == packed.dtype and x.stride(1) == 1 and packed.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _fn("gemm", x.dtype)(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), m, n, k)
    return out


def native_ready() -> bool:
    """Whether the native kernels are built and loaded here (CPU work only)."""
    return _library() is not None


def qgemm_isa() -> str:
    """Which integer path the quantized GEMM runs: avx512vnni, avx2 or generic (qgemm.cpp); the
    bits are the same on each."""
    lib = _library()
    return "torch" if lib is None else lib.isolab_qgemm_isa().decode()


def qgemm(x: torch.Tensor, packed: torch.Tensor, fmt: int, fp16: bool, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) bf16/fp32 @ W.T -> (M, n) in out_dtype, W packed by kernels.quant.pack (qgemm.cpp)."""
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    return qgemm_bound(packed, fmt, fp16, n, out_dtype)(x)


def qgemm_bound(packed: torch.Tensor, fmt: int, fp16: bool, n: int, out_dtype: torch.dtype | None):
    """qgemm with the weight's arguments bound once (a decode step makes ~120 of these calls: the
    checks are done here, not per call). out_dtype None: the input's."""
    lib = _library()
    assert lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous()
    call, wp, k = lib.isolab_qgemm, packed.data_ptr(), packed.shape[1] * 32
    bf16 = torch.bfloat16

    def run(x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, n)
        if x.stride(1) != 1 or x.shape[1] != k or x.dtype not in (bf16, torch.float32):
            raise ValueError(f"qgemm wants (M, {k}) bf16/fp32 rows with unit stride, not {tuple(x.shape)} {x.dtype}")
        m = x.shape[0]
        od = out_dtype or x.dtype
        out = torch.empty(m, n, dtype=od)
        if m:
            call(x.data_ptr(), x.dtype == bf16, x.stride(0), wp, fmt, fp16, out.data_ptr(), od == bf16, m, n, k)
        return out

    return run


def qdense_bound(packed: torch.Tensor, fmt: int, fp16: bool, n: int):
    """qdense.cpp (records laid out by quant.pack_rows, the dense bf16 GEMM's bits) with the
    weight's arguments bound once: bf16 (M, K) -> bf16 (M, n)."""
    lib = _library()
    assert lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous()
    from isolab.kernels import quant

    # the kernel reads ceil(n/16) panels of K/32 records of this format's size: nothing else
    assert packed.dim() == 3 and packed.shape[0] == -(-n // 16) and packed.shape[2] == quant.record_bytes(fmt, fp16)
    call, wp, k = lib.isolab_qdense, packed.data_ptr(), packed.shape[1] * 32
    bf16 = torch.bfloat16

    def run(x: torch.Tensor, _records: torch.Tensor = packed) -> torch.Tensor:  # (M, K) -> (M, n); holds the records
        if x.stride(1) != 1 or x.shape[1] != k or x.dtype != bf16:
            raise ValueError(f"qdense wants (M, {k}) bf16 rows with unit stride, not {tuple(x.shape)} {x.dtype}")
        m = x.shape[0]
        out = torch.empty(m, n, dtype=bf16)
        if m:
            call(x.data_ptr(), x.stride(0), wp, fmt, fp16, out.data_ptr(), m, n, k)
        return out

    return run


def qdense_record(record: torch.Tensor, fmt: int, fp16: bool, scalar: bool = False) -> torch.Tensor:
    """One record of quant.pack_rows -> its (16 columns, 32 k's) bf16 weights, by the kernel's
    vector path (or its scalar definition): for the tests."""
    lib = _library()
    assert lib is not None and record.dtype == torch.uint8 and record.is_contiguous()
    out = torch.empty(16, 32, dtype=torch.bfloat16)
    lib.isolab_qdense_record(record.data_ptr(), fmt, int(fp16), out.data_ptr(), int(scalar))
    return out


def qdense_isa() -> str:
    """Which code path qdense.cpp runs (--weights dense's blocks): amx (each block dequantized to a bf16 tile right
    before the tile unit takes it) or panels (blocks dequantized into gemm.cpp's bf16 panels)."""
    lib = _library()
    assert lib is not None
    return lib.isolab_qdense_isa().decode()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qgemm.cpp's quantized activations: (M, K) -> q int8 (M, K), da (M, K/32), xs (M, K/32)."""
    m, k = x.shape
    assert x.stride(1) == 1 and k % 32 == 0
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32)
    xs = torch.empty(m, k // 32)
    lib = _library()
    assert lib is not None, "quantize_rows needs the native kernels"
    lib.isolab_quantize_rows(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, k, q.data_ptr(),
                                    d.data_ptr(), xs.data_ptr())
    return q, d, xs


class FusedLinear(ctypes.Structure):
    """forward.cpp's Linear: one layer's weight for the one-call forward."""

    _fields_ = [("w", ctypes.c_void_p), ("quant", ctypes.c_int32), ("fmt", ctypes.c_int32), ("fp16", ctypes.c_int32),
                ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("pad_", ctypes.c_int32)]


class FusedLayer(ctypes.Structure):
    """forward.cpp's Layer: norms and the four linear layers."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("qkv", FusedLinear),
                ("o", FusedLinear), ("gate_up", FusedLinear), ("down", FusedLinear)]


FORWARD_OPS = ("gemm.wqkv", "rope", "attention", "gemm.wo", "add_rms_norm", "gemm.w_gate_up", "silu_mul", "gemm.w_down")


def forward_profile(on: bool) -> dict[str, float] | None:
    """Time each op inside the one-call native forward (forward.cpp), summed over calls: on=True
    zeroes the totals and starts; on=False stops and returns them in ms (None without the kernels).
    For bench/step_profile.py; costs two clock reads an op while on."""
    lib = _library()
    if lib is None:
        return None
    if on:
        lib.isolab_forward_profile(1)
        return {}
    lib.isolab_forward_profile(0)
    out = (ctypes.c_double * len(FORWARD_OPS))()
    if lib.isolab_forward_profile_read(out, len(FORWARD_OPS)) != len(FORWARD_OPS):
        raise BuildError("forward.cpp's ops and kernels.FORWARD_OPS disagree")
    return {name: out[i] / 1e6 for i, name in enumerate(FORWARD_OPS)}


def pointer_array(tensors: list[torch.Tensor]):
    """A C array of the tensors' data pointers (the caller keeps the tensors alive)."""
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def forward_layers(x: torch.Tensor, h: torch.Tensor, layers, k_pools, v_pools, num_layers: int,
                   final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, tables: torch.Tensor, row_table: torch.Tensor, q_pos: torch.Tensor,
                   heads: tuple[int, int, int], nb: int, bs: int, scale: float, eps: float, widths: tuple[int, int],
                   kv_i8: bool = False) -> None:
    """Every layer in one native call (forward.cpp): x (N, D) the residual stream, in place; h (N, D)
    layer 0's normed input on entry, the final norm's output on return. widths: (Wqkv, I). kv_i8:
    k_pools are the layers' int8 pools (v_pools unused)."""
    n, d = x.shape
    H, Hkv, Dh = heads
    wqkv, inter = widths
    dt = x.dtype
    bufs = [torch.empty(n, w, dtype=dt) for w in (wqkv, H * Dh, d, 2 * inter, inter)]
    _fn("forward", dt)(x.data_ptr(), h.data_ptr(), ctypes.byref(layers), k_pools, v_pools, num_layers,
                       final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                       tables.data_ptr(), tables.shape[1], row_table.data_ptr(), q_pos.data_ptr(), n, d, H, Hkv, Dh,
                       nb, bs, scale, eps, *[b.data_ptr() for b in bufs], int(kv_i8))
