"""Dense bf16 GEMMs on weights kept in their GGUF blocks (isolab/kernels/qdense.cpp): the same bits
as the dense isolab GEMM (gemm.cpp) on the weights `--weights dense` packs, at every M, on every
record format, on every ISA level this CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from isolab import kernels
from isolab.kernels import quant as Q

pytestmark = pytest.mark.skipif(not kernels.native_ready(), reason="native kernels do not build here")

FORMATS = [(Q.U4, True), (Q.U4, False), (Q.S8, True), (Q.S8, False), (Q.S8G16, False)]


def _dense_bf16(u: Q.Unpacked) -> torch.Tensor:
    """What `--weights dense` multiplies: the GGUF's values (fp32, one rounding an operation, as
    gguf.quants computes them and quant.dequantize_rows reads them back) cast to bf16."""
    n, k = u.q.shape
    return torch.from_numpy(Q.dequantize_rows(Q.pack(u), u.fmt, u.d.dtype == np.float16, np.arange(n), k)).to(torch.bfloat16)


@pytest.mark.parametrize("fmt,fp16", FORMATS)
@pytest.mark.parametrize("n,k", [(40, 64), (960, 576), (70, 1536)])
def test_the_dense_gemms_bits_at_every_m(fmt, fp16, n, k):
    u = Q.random_unpacked(fmt, n, k, fp16, seed=n + k)
    run = kernels.qdense_bound(Q.pack_rows(u), fmt, fp16, n)
    panels = kernels.pack_weight(_dense_bf16(u))
    g = torch.Generator().manual_seed(k)
    x = torch.randn(70, k, generator=g).to(torch.bfloat16)
    for m in (1, 3, 16, 17, 32, 33, 70):
        got, want = run(x[:m]), kernels.gemm(x[:m], panels, n)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, (got.float() - want.float()).abs().max())
    strided = torch.randn(5, 2 * k, generator=g).to(torch.bfloat16)[:, :k]  # rows with a stride (the kernel takes lda)
    assert torch.equal(run(strided).view(torch.int16), kernels.gemm(strided.contiguous(), panels, n).view(torch.int16))


@pytest.mark.parametrize("fmt,fp16", FORMATS)
def test_a_records_vector_dequantization_is_its_definition(fmt, fp16):
    """The vector path (a table per column for u4) against the scalar definition, value by value,
    and both against the GGUF's values cast to bf16; with extreme scales, zero, inf and NaN."""
    u = Q.random_unpacked(fmt, 16, 64, fp16, seed=7)
    sdt = u.d.dtype
    d = u.d.copy()
    d[:4, 0] = np.array([0.0, np.inf, np.nan, 6.0e4 if fp16 else 3.0e38], dtype=sdt)  # fp16 max, or near fp32's
    d[4, 0] = np.array(6.0e-8 if fp16 else 1.0e-38, dtype=sdt)  # the smallest steps (fp32: subnormal weights)
    q, mn = u.q.copy(), None if u.mn is None else u.mn.copy()
    q[4, :2] = 1  # d q = d: with fp32 scales a subnormal weight (mn 0 below), which the guard must keep
    if mn is not None:
        mn[4, 0] = 0
    u = Q.Unpacked(u.fmt, q, d, mn, u.qtype)
    rec = Q.pack_rows(u)[0, 0].contiguous()
    vec, scalar = kernels.qdense_record(rec, fmt, fp16), kernels.qdense_record(rec, fmt, fp16, scalar=True)
    assert torch.equal(vec.view(torch.int16), scalar.view(torch.int16))
    with np.errstate(invalid="ignore", over="ignore"):
        want = _dense_bf16(u)[:, :32]
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(scalar), nan) and int(nan.sum()) > 16  # (torch writes any NaN as 0xffff: NaN alike)
    assert torch.equal(scalar.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert torch.isinf(scalar).any()
    if not fp16:  # the subnormal weights are there, kept by the vector path too (not read as zero)
        assert float(scalar[4, 0]) != 0 and abs(float(scalar[4, 0])) < torch.finfo(torch.float32).tiny


def test_layout_is_the_gguf_nibble_order():
    """A u4 record's column bytes are the GGUF's Q4 layout (byte i = q[i] | q[i + 16] << 4): the
    records of a real Q4_1 tensor hold its own quant bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    n, k = 16, 64
    raw = quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1)
    u = Q.unpack_gguf(raw, "Q4_1", (n, k))
    rec = Q.pack_rows(u).numpy()  # (1, 2, 320)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // 32, 20)  # d, m, 16 bytes
    for b in range(k // 32):
        np.testing.assert_array_equal(rec[0, b, :256].reshape(16, 16), blocks[:, b, 4:])


HASH_SCRIPT = """
import hashlib, numpy as np, torch
from isolab import kernels
from isolab.kernels import quant as Q
h = hashlib.sha256()
for fmt, fp16 in [(Q.U4, True), (Q.U4, False), (Q.S8, True), (Q.S8G16, False)]:
    u = Q.random_unpacked(fmt, 100, 576, fp16, seed=3)
    run = kernels.qdense_bound(Q.pack_rows(u), fmt, fp16, 100)
    vals = Q.dequantize_rows(Q.pack(u), fmt, fp16, np.arange(100), 576)
    panels = kernels.pack_weight(torch.from_numpy(vals).to(torch.bfloat16))
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = run(x)
    assert torch.equal(got.view(torch.int16), kernels.gemm(x, panels, 100).view(torch.int16)), (fmt, fp16)
    h.update(got.view(torch.int16).numpy().tobytes())
print(kernels.qdense_isa(), kernels.gemm_isa(), h.hexdigest())
"""


def test_every_isa_level_gives_its_dense_gemms_bits():
    """At each level the kernels build for (the tile unit's path where the level has AMX, gemm.cpp
    on dequantized panels elsewhere) the blocks give that level's dense GEMM bits; levels whose
    dense GEMM is the same chain agree with each other too."""
    by_chain: dict[str, set[str]] = {}
    for level in kernels.isa_levels():
        env = {**os.environ, "ISOLAB_KERNEL_ISA": level}
        out = subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (level, out.stderr[-2000:])
        _, chain, digest = out.stdout.split()
        by_chain.setdefault(chain, set()).add(digest)
    assert all(len(d) == 1 for d in by_chain.values()), by_chain


def test_the_path_named():
    assert kernels.qdense_isa() in ("amx", "panels")
    assert kernels.qdense_isa() == ("amx" if kernels.gemm_isa() == "amx" else "panels")


GUARD_SCRIPT = """
import ctypes, mmap, sys, numpy as np, torch
from isolab import kernels
from isolab.kernels import quant as Q
n, k = int(sys.argv[1]), int(sys.argv[2])
u = Q.random_unpacked(Q.U4, n, k, True, seed=5)
rec = Q.pack_rows(u).numpy()
page = mmap.PAGESIZE
size = -(-rec.nbytes // page) * page
buf = mmap.mmap(-1, size + page)  # the records end exactly where a page no one may read begins
libc = ctypes.CDLL(None)
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert libc.mprotect(ctypes.c_void_p(base + size), page, 0) == 0  # PROT_NONE
arr = np.frombuffer(buf, np.uint8, rec.nbytes, size - rec.nbytes).reshape(rec.shape)
arr[...] = rec
records = torch.from_numpy(arr)
x = torch.randn(40, k).to(torch.bfloat16)
panels = kernels.pack_weight(torch.from_numpy(Q.dequantize_rows(Q.pack(u), Q.U4, True, np.arange(n), k)).to(torch.bfloat16))
out = kernels.qdense_bound(records, Q.U4, True, n)(x)
assert torch.equal(out.view(torch.int16), kernels.gemm(x, panels, n).view(torch.int16))
print("ok")
"""


@pytest.mark.parametrize("n", [16, 40, 48, 80])
def test_no_read_past_the_records(n):
    """An odd number of 16-column panels: the last work item (32 columns) has one panel, and nothing
    past it is read (the records end at a page no one may read; a read past them is a crash)."""
    out = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, str(n), "64"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-1500:])


@pytest.mark.parametrize("qtype", Q.NATIVE_TYPES)
def test_against_gguf_own_dequantization(qtype):
    """Real GGUF blocks of each native type (gguf's quantizer, or random valid K-quant blocks): the
    kernel's weights are gguf.quants.dequantize's cast to bf16, what the dense path packs. (Q4_0's
    records hold mn = -8 d, so a weight of q = 8 is +0 where gguf's d (q - 8) is -0 for d < 0: a sum
    from +0 cannot tell them apart, so the GEMM's bits agree; the weights are compared with that
    sign left out.)"""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tests.kernels.test_qgemm import _gguf_tensor

    n, k = 32, 512
    raw = _gguf_tensor(qtype, n, k, seed=2)
    u = Q.unpack_gguf(raw, qtype, (n, k))
    fmt, fp16 = Q.RECORD_FORMATS[qtype]
    if u.fmt != fmt:  # (u4 beside s8 never: each type has one format)
        pytest.fail(f"{qtype}: {u.fmt} against {fmt}")
    rows = Q.pack_rows(u)
    got = torch.cat([torch.cat([kernels.qdense_record(rows[p, b].contiguous(), fmt, u.d.dtype == np.float16)
                                for b in range(k // 32)], dim=1) for p in range(n // 16)])
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)).to(torch.bfloat16)
    g, w = got.view(torch.int16), want.view(torch.int16)
    if qtype == "Q4_0":
        g, w = g & 0x7FFF, w & 0x7FFF  # (the sign of zero, above)
        assert torch.equal(got == 0, want == 0)
    assert torch.equal(g, w)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = kernels.qdense_bound(rows, fmt, u.d.dtype == np.float16, n)(x)
    assert torch.equal(out.view(torch.int16), kernels.gemm(x, kernels.pack_weight(want), n).view(torch.int16))


def test_records_of_another_shape_or_format_are_refused():
    """The kernel reads ceil(n / 16) panels of records of its format's size: records that do not fit
    the arguments are refused before a call could read past them."""
    u = Q.random_unpacked(Q.U4, 40, 64, True, seed=1)
    rows = Q.pack_rows(u)
    kernels.qdense_bound(rows, Q.U4, True, 40)  # fits
    for args in ((Q.U4, True, 64), (Q.U4, False, 40), (Q.S8, True, 40)):
        with pytest.raises(AssertionError):
            kernels.qdense_bound(rows, *args)
