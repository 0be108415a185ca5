"""The quantized GEMM (isolab/kernels/qgemm.cpp): exact unpacking of GGUF blocks, the same bits as
its torch reference and on every ISA level, batch invariance by construction, and its accuracy
against the dense weights."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from isolab import kernels
from isolab.kernels import quant as Q

pytestmark = pytest.mark.skipif(not kernels.native_ready(), reason="native kernels do not build here")

FORMATS = [(Q.U4, True), (Q.U4, False), (Q.S8, True), (Q.S8G16, False)]
CPU = torch.device("cpu")


def _gguf_tensor(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A real GGUF tensor's bytes: quantized by the gguf package, or random valid blocks for the
    K-quants (the package has no quantizer for them)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    t = GGMLQuantizationType[qtype]
    if qtype in ("Q4_K", "Q6_K"):
        block, size = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        scale = np.array([0.01 * rng.random()], dtype=np.float16).view(np.uint8)
        at = (0, 2) if qtype == "Q4_K" else (size - 2,)  # d (and dmin): finite fp16
        for a in at:
            raw[..., a : a + 2] = scale
        return raw.reshape(n, -1)
    return quantize(rng.standard_normal((n, k)).astype(np.float32), t)


@pytest.mark.parametrize("qtype", Q.NATIVE_TYPES)
def test_unpacking_is_exact_against_gguf_dequantize(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 48, 512
    raw = _gguf_tensor(qtype, n, k)
    u = Q.unpack_gguf(raw, qtype, (n, k))
    assert u.fmt == Q.RECORD_FORMATS[qtype][0]
    np.testing.assert_array_equal(u.dense(), dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k))


@pytest.mark.parametrize("fmt,fp16", FORMATS)
@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (100, 1536)])
def test_kernel_gives_the_torch_reference_bits(fmt, fp16, n, k):
    u = Q.random_unpacked(fmt, n, k, fp16, seed=n + k)
    packed, ref = Q.pack(u), Q.TorchUnpacked(u, CPU)
    g = torch.Generator().manual_seed(1)
    for m in (1, 7, 13, 64):  # every tail of a tile of 8 (or 4) rows: 7, 8 + 5, 4 + 3
        for in_dt in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(in_dt)
            for out_dt in (torch.float32, torch.bfloat16):
                ours = kernels.qgemm(x, packed, fmt, fp16, n, out_dt)
                assert torch.equal(ours, Q.qgemm_ref(x, ref, out_dt)), (m, in_dt, out_dt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_quantization_matches_the_reference(dtype):
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(4))
    x[0, :32] = 0.0  # a block of zeros: scale 0
    x[1, 32:64] = 1e-30  # a block of tiny values (127 / amax is huge, still finite)
    x[2, 64:96] = torch.linspace(-3e4, 3e4, 32)  # large magnitudes, a tie at zero
    x[3, 96:128] = torch.arange(32) - 15.5  # exact halves: ties to even after scaling
    x = x.to(dtype)  # bf16 inputs hit exact rounding ties often
    q, d, xs = kernels.quantize_rows(x)
    rq, rd, rxs = Q.quantize_rows_ref(x)
    assert torch.equal(q.float().view(9, -1, 32), rq) and torch.equal(d, rd) and torch.equal(xs, rxs)


@pytest.mark.parametrize("fmt,fp16", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(fmt, fp16):
    n, k = 200, 576
    u = Q.random_unpacked(fmt, n, k, fp16, seed=3)
    packed = Q.pack(u)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = kernels.qgemm(x, packed, fmt, fp16, n, torch.bfloat16)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 33, 97):
        for s in (0, 130 - m):
            assert torch.equal(kernels.qgemm(x[s : s + m], packed, fmt, fp16, n, torch.bfloat16), full[s : s + m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.qgemm(x, packed, fmt, fp16, n, torch.bfloat16), full)
    finally:
        torch.set_num_threads(threads)
    try:  # tiles of 4 rows (8 is the AVX-512 default, 3 AVX2's), of 3 and of 1: the same bits
        for rows in (4, 3, 1):
            kernels.qgemm_tile_rows(rows)
            assert torch.equal(kernels.qgemm(x, packed, fmt, fp16, n, torch.bfloat16), full)
    finally:
        kernels.qgemm_tile_rows()


def _schedules_keep_one_threads_bits(fmt, fp16, n: int, seed: int, threads: tuple[int, ...],
                                     settings: tuple[tuple[bool, bool, bool], ...]) -> None:
    """130 rows (two chunks of QMC) of two inputs in turn against the packed weight, at each thread
    count and (sharing, thread 0 late, task order) setting, must give one thread's bits with the
    plain static order. Two inputs: an output buffer the allocator hands back still holds the
    other's result, so a task that lands nowhere cannot pass for done."""
    k = 576
    packed = Q.pack(Q.random_unpacked(fmt, n, k, fp16, seed=seed))
    xs = [torch.randn(130, k, generator=torch.Generator().manual_seed(seed + s)).to(torch.bfloat16) for s in (1, 2)]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernels.balance(False)
        kernels.qgemm_order(False)
        refs = [kernels.qgemm(x, packed, fmt, fp16, n, torch.bfloat16) for x in xs]
        for t in threads:
            torch.set_num_threads(t)
            for share, late, order in settings:
                kernels.balance(share, late_first_thread=late)
                kernels.qgemm_order(order)
                for x, ref in zip(xs, refs, strict=True):
                    got = kernels.qgemm(x, packed, fmt, fp16, n, torch.bfloat16)
                    assert torch.equal(got, ref), (t, share, late, order)
    finally:
        kernels.balance(True)
        kernels.qgemm_order(True)
        torch.set_num_threads(saved)


@pytest.mark.parametrize("fmt,fp16", FORMATS)
def test_which_thread_runs_a_task_changes_no_bit(fmt, fp16):
    """balance.h: a thread whose tasks are done takes another's. With thread 0 held back, the others
    run its whole share (rows in two chunks of QMC, panels in groups): every output must still land
    where it belongs, with the bits of a static schedule and of one thread."""
    _schedules_keep_one_threads_bits(fmt, fp16, 200, 5, (2, 3, 5),
                                     ((False, False, True), (True, False, True), (True, True, True)))


@pytest.mark.parametrize("fmt,fp16", [(Q.U4, True), (Q.S8, True)])
def test_task_order_and_prefetch_change_no_bit(fmt, fp16):
    """Weights larger than the quantized rows (a vocabulary head) are taken group by group, every
    row chunk of a group before the next, with the next task's panels prefetched. Neither may change
    a bit: every thread count, task order, and thread 0 held back give one thread's result."""
    # 12,000 columns: records far larger than the 130 rows' quantized A, either format
    _schedules_keep_one_threads_bits(fmt, fp16, 12000, 7, (2, 3),
                                     ((True, False, True), (True, True, True), (True, False, False)))


HASH_SCRIPT = """
import hashlib, torch
from isolab import kernels
from isolab.kernels import quant as Q
h = hashlib.sha256()
for fmt, fp16 in [(Q.U4, True), (Q.U4, False), (Q.S8, True), (Q.S8G16, False)]:
    u = Q.random_unpacked(fmt, 100, 576, fp16, seed=3)
    p = Q.pack(u)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(1))
    h.update(kernels.qgemm(x, p, fmt, fp16, 100, torch.float32).numpy().tobytes())
    h.update(kernels.qgemm(x[:1].bfloat16(), p, fmt, fp16, 100, torch.bfloat16).view(torch.int16).numpy().tobytes())
# activation quantization on every ISA's own path, NaN and infinities included (outside the reference)
x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(4))
x[0, :32] = 0.0
x[1, 32:64] = 1e-30
x[2, 64:96] = torch.linspace(-3e4, 3e4, 32)
x[3, 96:128] = torch.arange(32) - 15.5
x[4, 5], x[4, 40], x[4, 70], x[4, 71] = float("nan"), float("inf"), float("-inf"), float("nan")
x[4, 127] = x[4, 152] = float("nan")  # a block's last k's and a middle one: a vector loop's last and first
g = hashlib.sha256()
for t in (x, x.bfloat16()):
    for part in kernels.quantize_rows(t):
        g.update(part.numpy().tobytes())
print(kernels.qgemm_isa(), h.hexdigest(), g.hexdigest())
"""


def test_every_isa_level_gives_the_same_bits():
    """AVX-512 VNNI, AVX2 (maddubs) and plain C compute the integer part three ways: exact, so the
    results agree bit for bit; the torch reference too (every level, the AMX one included)."""
    levels = kernels.isa_levels()
    seen: dict[str, str] = {}
    quantize_seen: dict[str, str] = {}  # the activations' blocks, NaN and infinities included
    for level in levels:
        env = {**os.environ, "ISOLAB_KERNEL_ISA": level}
        out = subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        isa, digest, quantized = out.stdout.split()
        seen[f"{level}:{isa}"] = digest
        quantize_seen[f"{level}:{isa}"] = quantized
    h = hashlib.sha256()
    for fmt, fp16 in FORMATS:
        u = Q.random_unpacked(fmt, 100, 576, fp16, seed=3)
        ref = Q.TorchUnpacked(u, CPU)
        x = torch.randn(13, 576, generator=torch.Generator().manual_seed(1))
        h.update(Q.qgemm_ref(x, ref, torch.float32).numpy().tobytes())
        h.update(Q.qgemm_ref(x[:1].bfloat16(), ref, torch.bfloat16).view(torch.int16).numpy().tobytes())
    seen["torch-reference"] = h.hexdigest()
    assert len(set(seen.values())) == 1, seen
    assert len(seen) >= 3  # native, generic and the reference at least
    assert len(set(quantize_seen.values())) == 1, quantize_seen


@pytest.mark.parametrize("fmt,fp16", FORMATS)
def test_error_against_the_dense_weights_is_the_activation_rounding(fmt, fp16):
    """The stated tolerance: quantizing activations to 8 bits a block of 32 (as llama.cpp does) costs
    about 0.5 % relative error on random data; it is the only approximation (weights are exact)."""
    n, k = 256, 1024
    u = Q.random_unpacked(fmt, n, k, fp16, seed=5)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(0))
    ours = kernels.qgemm(x, Q.pack(u), fmt, fp16, n, torch.float32).double()
    exact = x.double() @ torch.from_numpy(u.dense()).double().T
    rel = float((ours - exact).norm() / exact.norm())
    assert rel < 0.01, rel
    # and it is an approximation, not an accident: fp32 dense rounding alone is far smaller
    dense = (x @ torch.from_numpy(u.dense()).T).double()
    assert float((dense - exact).norm() / exact.norm()) < rel / 10


def test_weights_of_two_record_formats_run_side_by_side():
    """A u4 part beside an s8 part (Q4_K q/k beside a Q6_K v) cannot share one GEMM: StackedWeight
    runs each and concatenates, the same bits as each part alone."""
    from isolab.models.linear import QuantWeight, StackedWeight

    parts = [Q.random_unpacked(Q.U4, 48, 128, True, seed=1), Q.random_unpacked(Q.S8G16, 32, 128, False, seed=2)]
    with pytest.raises(ValueError):
        Q.concat(parts)
    alone = [QuantWeight(p, CPU, True) for p in parts]
    stacked = StackedWeight(alone)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert stacked.n == 80 and torch.equal(stacked(x), torch.cat([w(x) for w in alone], dim=1))


def test_concat_promotes_scales_exactly():
    a = Q.random_unpacked(Q.S8, 16, 64, True, seed=1)
    b = Q.random_unpacked(Q.S8G16, 32, 64, False, seed=2)
    c = Q.concat([a, b])
    assert c.fmt == Q.S8G16 and c.d.dtype == np.float32
    np.testing.assert_array_equal(c.dense(), np.concatenate([a.dense(), b.dense()]))
    with pytest.raises(ValueError):
        Q.concat([a, Q.random_unpacked(Q.U4, 16, 64, True)])


@pytest.mark.parametrize("qtype", Q.NATIVE_TYPES)
def test_rows_read_back_from_the_records_are_the_gguf_values(qtype):
    """A tied embedding table is read from the head's records (models/llama.py: PackedEmbedding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 40, 512
    raw = _gguf_tensor(qtype, n, k, seed=7)
    u = Q.unpack_gguf(raw, qtype, (n, k))
    ids = np.array([0, 39, 17, 16, 15, 17])
    rows = Q.dequantize_rows(Q.pack(u), u.fmt, u.d.dtype == np.float16, ids, k)
    np.testing.assert_array_equal(rows, dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)[ids])
