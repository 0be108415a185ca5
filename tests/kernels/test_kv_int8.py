"""The 8-bit K/V pool (kv_cache_dtype "int8"): the kernel writes the bytes the torch writer does,
attends as the torch path does over the dequantized values, reads only a row's own keys 0..pos,
gives a row the same bits alone, in a batch or in a prompt chunk, and the same bits at every ISA
level where it computes in fp32; and its rounding against the 16-bit pool is what the docs state."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from isolab import kernels
from isolab.models.attention import (
    attention_core,
    gather_kv_i8,
    i8_pool_shape,
    quantize_keys_i8,
    write_kv,
    write_kv_i8,
)

DTYPES = {"bf16": (torch.bfloat16, 2e-2), "fp32": (torch.float32, 2e-5)}
SHAPES = [(9, 3, 64, 16), (9, 3, 64, 32), (14, 2, 64, 16), (4, 1, 256, 16), (8, 2, 128, 48), (2, 2, 64, 16),
          (4, 2, 16, 16), (6, 3, 96, 16)]


def _kv(n, hkv, dh, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # keys of very different sizes (a scale a key must follow each), one all-zero key
    k = torch.randn(n, hkv, dh, generator=g) * torch.rand(n, hkv, 1, generator=g) * 4
    k[n // 2] = 0
    v = torch.randn(n, hkv, dh, generator=g)
    return k.to(dtype), v.to(dtype)


def _case(dtype, heads, hkv, dh, bs, rows=10, nb=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = rows * nb + 1
    pool = torch.zeros(i8_pool_shape(hkv, num_blocks, bs, dh), dtype=torch.int8)
    slots = torch.arange(bs, num_blocks * bs)  # block 0 stays the null block
    k, v = _kv(len(slots), hkv, dh, dtype, seed)
    write_kv_i8(pool, slots, k, v)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: rows * nb] + 1).view(rows, nb).to(torch.int32)
    pos = torch.randint(0, nb * bs, (rows,), generator=g).to(torch.int32)
    q = torch.randn(rows, heads, dh, generator=g).to(dtype)
    return q, pool, tables, pos


def _reference(q, pool, tables, pos, window=0):
    """The torch path: dequantize the rows' blocks (fp32), then attention_core."""
    rows, dh = q.shape[0], q.shape[2]
    k, v = gather_kv_i8(pool, tables.long(), torch.float32)
    return attention_core(q.float().view(rows, 1, *q.shape[1:]), k, v, pos.long().view(rows, 1), dh**-0.5,
                          window=window).view(q.shape)


def write_by_kernel(pool, slots, k, v, heads):
    """The kernel's own write: k, v (n, Hkv, Dh) as rows of one qkv buffer, as the model hands them."""
    n, hkv, dh = k.shape
    qkv = torch.cat([torch.zeros(n, heads, dh, dtype=k.dtype), k, v], 1).contiguous().view(n, -1)
    kernels.paged_attention(qkv[:, : heads * dh].view(n, heads, dh), pool, torch.zeros(1, 1, dtype=torch.int32),
                            torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32), 0.125,
                            new_kv=(qkv[:, heads * dh: (heads + hkv) * dh].view(n, hkv, dh),
                                    qkv[:, (heads + hkv) * dh:].view(n, hkv, dh), slots))


def _attend(q, pool, tables, pos, row_table=None, window=0):
    rt = torch.arange(q.shape[0], dtype=torch.int32) if row_table is None else row_table
    return kernels.paged_attention(q, pool, tables, rt, pos, q.shape[2] ** -0.5, window=window)


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("heads,hkv,dh,bs", SHAPES)
def test_the_kernel_writes_the_bytes_the_torch_writer_does(dname, heads, hkv, dh, bs):
    dtype = DTYPES[dname][0]
    nb, n = 8, 90
    k, v = _kv(n, hkv, dh, dtype, seed=1)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(2))[:n]
    by_torch = torch.zeros(i8_pool_shape(hkv, nb, bs, dh), dtype=torch.int8)
    write_kv_i8(by_torch, slots, k, v)
    by_kernel = torch.zeros_like(by_torch)
    write_by_kernel(by_kernel, slots, k, v, heads)
    assert torch.equal(by_kernel, by_torch)


def test_quantization_rule():
    x = torch.tensor([[0.0, 1.0, -2.0, 0.5], [0.0, 0.0, 0.0, 0.0], [1.0, float("nan"), 0.0, 0.0],
                      [127.0, 62.5, -62.5, 0.5], [1.0, float("inf"), 0.0, 0.0]])
    q, s = quantize_keys_i8(x)
    assert s[0].item() == pytest.approx(2 / 127) and q[0].tolist() == [0, 64, -127, 32]
    assert s[1].item() == 0 and q[1].tolist() == [0, 0, 0, 0]
    assert torch.isnan(s[2]) and q[2].tolist() == [0, 0, 0, 0]  # the NaN is kept where a read sees it: the scale
    assert s[3].item() == 1.0 and q[3].tolist() == [127, 62, -62, 0]  # ties to even (away from zero: 63, -63, 1)
    assert torch.isnan(s[4]) and q[4].tolist() == [0, 0, 0, 0]  # an infinity too


@pytest.mark.parametrize("dname", DTYPES)
def test_the_kernel_writes_the_same_bytes_for_ties_nans_and_infinities(dname):
    """The writers agree where they could part: ties, NaNs of any payload (one quiet NaN scale), infinities."""
    dtype = DTYPES[dname][0]
    hkv, dh = 2, 64
    k, v = _kv(6, hkv, dh, dtype, seed=3)
    k[0, 0, :2] = torch.tensor([127.0, 62.5])  # scale 1: a tie at 62.5
    k[1, 1, 5] = float("nan")
    k[2, 0, 7] = float("-inf")
    v[3, 1, 0] = torch.tensor(float("nan")).to(dtype)
    if dtype == torch.float32:  # a NaN with another payload than torch's
        k[4, 0].view(torch.int32)[3] = 0x7FA00001
    slots = torch.arange(6) * 3
    by_torch = torch.zeros(i8_pool_shape(hkv, 2, 16, dh), dtype=torch.int8)
    write_kv_i8(by_torch, slots, k, v)
    by_kernel = torch.zeros_like(by_torch)
    write_by_kernel(by_kernel, slots, k, v, 4)
    assert torch.equal(by_kernel, by_torch)


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("heads,hkv,dh,bs", SHAPES)
@pytest.mark.parametrize("fast", [True, False])
def test_attention_matches_the_torch_path_over_the_dequantized_values(dname, heads, hkv, dh, bs, fast):
    """fast: AMX tiles where the CPU has them (bf16, Dh 64); off: every row in fp32 arithmetic."""
    dtype, tol = DTYPES[dname]
    q, pool, tables, pos = _case(dtype, heads, hkv, dh, bs)
    kernels.attention_fast_paths(fast)
    try:
        out = _attend(q, pool, tables, pos)
    finally:
        kernels.attention_fast_paths(True)
    assert (out.float() - _reference(q, pool, tables, pos)).abs().max().item() < tol


@pytest.mark.parametrize("window", [7, 40])
def test_a_sliding_window_is_kept(window):
    q, pool, tables, pos = _case(torch.float32, 4, 1, 256, 16, seed=3)
    out = _attend(q, pool, tables, pos, window=window)
    assert (out - _reference(q, pool, tables, pos, window)).abs().max().item() < 2e-5


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("fast", [True, False])
def test_a_row_gets_the_same_bits_alone_in_a_batch_or_in_a_chunk(dname, fast):
    dtype = DTYPES[dname][0]
    q, pool, tables, pos = _case(dtype, 9, 3, 64, 16, rows=12, nb=6)
    kernels.attention_fast_paths(fast)
    try:
        batch = _attend(q, pool, tables, pos)
        for r in range(q.shape[0]):
            alone = _attend(q[r: r + 1], pool, tables[r: r + 1], pos[r: r + 1])
            assert torch.equal(alone, batch[r: r + 1]), r
        # a prompt's 40 queries as one chunk (one table: AMX takes them as units of rows) vs one at a time
        chunk_pos = torch.arange(40, dtype=torch.int32)
        qs = q[:1].expand(40, -1, -1).contiguous() + torch.linspace(0, 1, 40).view(40, 1, 1).to(dtype)
        chunk = _attend(qs, pool, tables[:1], chunk_pos, row_table=torch.zeros(40, dtype=torch.int32))
        for t in range(40):
            one = _attend(qs[t: t + 1], pool, tables[:1], chunk_pos[t: t + 1])
            assert torch.equal(one, chunk[t: t + 1]), t
    finally:
        kernels.attention_fast_paths(True)


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("fast", [True, False])
def test_only_keys_up_to_the_position_in_the_rows_own_table_are_read(dname, fast):
    """Poison (every byte 0xFF: NaN scales, as the audit poisons a freed block) every run a row must
    not see: its output stays finite. Poisoning a key it does see makes that row NaN, no other."""
    dtype = DTYPES[dname][0]
    q, pool, tables, pos = _case(dtype, 9, 3, 64, 16, rows=6, nb=4, seed=4)
    rows = q.shape[0]
    kernels.attention_fast_paths(fast)
    try:
        clean = _attend(q, pool, tables, pos)
        for r in range(rows):
            p = pool.clone()
            seen = {int(b) for b in tables[r, : int(pos[r]) // 16 + 1]}
            for b in range(p.shape[1]):
                if b not in seen:
                    p[:, b] = -1
            last = int(tables[r, int(pos[r]) // 16])  # slots after pos in the row's last block
            after = torch.arange(int(pos[r]) % 16 + 1, 16)
            if len(after):
                write_kv_i8(p, last * 16 + after, torch.full((len(after), 3, 64), float("nan")).to(dtype),
                            torch.full((len(after), 3, 64), float("nan")).to(dtype))
            out = _attend(q[r: r + 1], p, tables[r: r + 1], pos[r: r + 1])
            assert torch.equal(out, clean[r: r + 1]), r
        p = pool.clone()
        p[:, int(tables[2, 0])] = -1  # block 0 of row 2's table: key 0 is seen by row 2
        out = _attend(q, p, tables, pos)
        nan_rows = {r for r in range(rows) if torch.isnan(out[r]).any()}
        assert nan_rows == {r for r in range(rows) if int(tables[2, 0]) in tables[r, : int(pos[r]) // 16 + 1].tolist()}
    finally:
        kernels.attention_fast_paths(True)


def test_the_rounding_against_the_16_bit_pool():
    """What int8 costs a row's attention output against the bf16 pool, on random keys of very different
    sizes: about 1% of the output's size for the median (row, head), under 4% for the worst here (the
    more peaked the attention, the more a score's rounding moves it). The real model's figures are
    tests/models' (docs/engine.md, 'An 8-bit K/V cache')."""
    dtype = torch.bfloat16
    heads, hkv, dh, bs, rows, nb = 9, 3, 64, 16, 10, 8
    g = torch.Generator().manual_seed(7)
    num_blocks = rows * nb + 1
    slots = torch.arange(bs, num_blocks * bs)
    k, v = _kv(len(slots), hkv, dh, dtype, seed=7)
    p16 = torch.zeros(2, hkv, num_blocks, bs, dh, dtype=dtype)
    write_kv(p16, slots, k, v)
    p8 = torch.zeros(i8_pool_shape(hkv, num_blocks, bs, dh), dtype=torch.int8)
    write_kv_i8(p8, slots, k, v)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: rows * nb] + 1).view(rows, nb).to(torch.int32)
    pos = torch.randint(16, nb * bs, (rows,), generator=g).to(torch.int32)
    q = torch.randn(rows, heads, dh, generator=g).to(dtype)
    a = _attend(q, p16, tables, pos).float()
    b = _attend(q, p8, tables, pos).float()
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1)  # (rows, heads)
    assert 0 < rel.median().item() < 0.015 and rel.max().item() < 0.04


HASH_SCRIPT = """
import hashlib, torch
from isolab import kernels
from tests.kernels.test_kv_int8 import _case, _attend, _kv, write_by_kernel
from isolab.models.attention import i8_pool_shape
h = hashlib.sha256()
kernels.attention_fast_paths(False)  # the fp32 path: the one every level has
for dtype in (torch.bfloat16, torch.float32):
    for heads, hkv, dh, bs in ((9, 3, 64, 16), (4, 1, 256, 32)):
        q, pool, tables, pos = _case(dtype, heads, hkv, dh, bs)
        h.update(pool.numpy().tobytes())
        h.update(_attend(q, pool, tables, pos).view(torch.uint8).numpy().tobytes())
        n = 40
        k, v = _kv(n, hkv, dh, dtype, 9)
        p = torch.zeros(i8_pool_shape(hkv, 4, bs, dh), dtype=torch.int8)
        write_by_kernel(p, torch.arange(n), k, v, heads)
        h.update(p.numpy().tobytes())
print(kernels.attention_isa(), h.hexdigest())
"""


def test_every_isa_level_gives_the_same_bits():
    """The fp32 path (and the kernel's writes) are the same arithmetic at AVX-512, AVX2 and plain C:
    no fused multiply-add, the same order, exact int8 -> fp32 conversions."""
    seen: dict[str, str] = {}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for level in kernels.isa_levels():
        env = {**os.environ, "ISOLAB_KERNEL_ISA": level, "PYTHONPATH": root}
        out = subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                             cwd=root)
        assert out.returncode == 0, out.stderr[-2000:]
        isa, digest = out.stdout.split()
        seen[f"{level}:{isa}"] = digest
    assert len(seen) >= 2 and len(set(seen.values())) == 1, seen
