"""Owns isolab's one native kernel: paged attention that reads K/V straight from the pool.

Built on first use with the system C++ compiler into ~/.cache/isolab/kernels (keyed by the
source, the flags, the compiler and the CPU), loaded with ctypes, and run on torch's own OpenMP
threads (the .so links the libgomp that torch has already loaded). Where it cannot be built (no
compiler, not x86-64 Linux, a GPU tensor), `available()` is False and the model falls back to
the torch path in `models/llama.py:attention_core`; `ISOLAB_NATIVE_ATTENTION=0` forces that.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
MAX_GROUP = 8  # query heads per KV head the kernel's stack buffers hold
MAX_HEAD_DIM = 256


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "isolab" / "kernels"


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ISOLAB_NATIVE_ATTENTION", "1") == "0":
        return None
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None or platform.system() != "Linux":
        log.warning("no C++ compiler: paged attention runs on the torch path (slower)")
        return None
    src = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(), _cpu_id().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            res = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
            if res.returncode != 0:
                log.warning("building the paged attention kernel failed; using the torch path: %s", res.stderr[-500:])
                return None
            os.replace(out, target)  # atomic: concurrent builders each land a whole file
    lib = ctypes.CDLL(str(target))
    for name in ("isolab_paged_attention_bf16", "isolab_paged_attention_fp32"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + \
            [ctypes.c_long] + [ctypes.c_int] * 2 + [ctypes.c_float]
    return lib


def available(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and _library() is not None)


def paged_attention(
    q: torch.Tensor,  # (N, H, Dh) queries, one per row
    kv: torch.Tensor,  # (2, Hkv, num_blocks, bs, Dh) one layer's pool; K blocks hold (Dh, bs) (llama.write_kv)
    tables: torch.Tensor,  # (R, table_len) int32 block tables
    row_table: torch.Tensor,  # (N,) int32: which table each row reads
    q_pos: torch.Tensor,  # (N,) int32: row n attends to keys 0..q_pos[n], all inside its table
    scale: float,
) -> torch.Tensor:  # (N, H, Dh)
    lib = _library()
    assert lib is not None
    q = q.contiguous()
    N, H, Dh = q.shape
    _, hkv, nb, bs, _ = kv.shape
    assert kv.is_contiguous() and q.dtype == kv.dtype
    assert tables.dtype == row_table.dtype == q_pos.dtype == torch.int32 and tables.is_contiguous()
    out = torch.empty_like(q)
    fn = lib.isolab_paged_attention_bf16 if q.dtype == torch.bfloat16 else lib.isolab_paged_attention_fp32
    fn(q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), tables.data_ptr(), tables.shape[1],
       row_table.data_ptr(), q_pos.data_ptr(), out.data_ptr(), N, H, hkv, nb, bs, Dh, scale)
    return out
