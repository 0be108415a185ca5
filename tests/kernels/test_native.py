"""isolab's native kernels (isolab/kernels) against the torch ops they replace, their reads of
the paged pool (only keys 0..pos, only the row's own table), row independence, and the fallback
when they cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from isolab import kernels
from isolab.models.attention import attention_core, gather_kv, write_kv

DTYPES = {"bf16": (torch.bfloat16, 2e-2), "fp32": (torch.float32, 2e-5)}
CPU = torch.device("cpu")


def test_kernels_build_here():
    """CI must run the native path, not silently the fallback: a C++ compiler is part of the setup."""
    assert kernels.available(CPU, torch.bfloat16, 9, 3, 64)
    assert kernels.available(CPU, torch.float32, 4, 2, 16)
    assert not kernels.available(torch.device("meta"), torch.bfloat16, 9, 3, 64)


def _pool(dtype, hkv, dh, bs, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.zeros(2, hkv, num_blocks, bs, dh, dtype=dtype)
    slots = torch.arange(bs, num_blocks * bs)  # block 0 stays the null block
    k = torch.randn(len(slots), hkv, dh, generator=g).to(dtype)
    v = torch.randn(len(slots), hkv, dh, generator=g).to(dtype)
    write_kv(kv, slots, k, v)
    return kv


def _case(dtype, heads, hkv, dh, bs, rows=12, nb=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = rows * nb + 1
    kv = _pool(dtype, hkv, dh, bs, num_blocks, seed)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: rows * nb] + 1).view(rows, nb).to(torch.int32)
    pos = torch.randint(0, nb * bs, (rows,), generator=g).to(torch.int32)
    q = torch.randn(rows, heads, dh, generator=g).to(dtype)
    return q, kv, tables, pos


def _torch_reference(q, kv, tables, pos):
    _, hkv, num_blocks, bs, dh = kv.shape
    rows, nb = tables.shape
    ids = tables.long().view(-1)
    planes = torch.arange(2 * hkv).view(-1, 1) * num_blocks
    k, v = gather_kv(kv, (planes + ids).view(-1), rows)
    return attention_core(q.view(rows, 1, *q.shape[1:]), k, v, pos.long().view(rows, 1), dh**-0.5).view(q.shape)


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("heads,hkv,dh,bs", [(9, 3, 64, 16), (4, 2, 16, 16), (6, 3, 32, 8), (4, 4, 64, 16),
                                             (9, 3, 64, 32), (9, 3, 64, 64), (6, 3, 32, 48)])
def test_paged_attention_matches_the_torch_path(dname, heads, hkv, dh, bs):
    dtype, tol = DTYPES[dname]
    q, kv, tables, pos = _case(dtype, heads, hkv, dh, bs)
    rows = q.shape[0]
    out = kernels.paged_attention(q, kv, tables, torch.arange(rows, dtype=torch.int32), pos, dh**-0.5)
    ref = _torch_reference(q, kv, tables, pos)
    assert (out.float() - ref.float()).abs().max().item() < tol


@pytest.mark.parametrize("dname", DTYPES)
def test_a_row_gets_the_same_bits_alone_in_a_batch_or_in_a_chunk(dname):
    dtype, _ = DTYPES[dname]
    q, kv, tables, pos = _case(dtype, 9, 3, 64, 16, rows=16)
    rows = q.shape[0]
    every = torch.arange(rows, dtype=torch.int32)
    batch = kernels.paged_attention(q, kv, tables, every, pos, 0.125)
    for r in range(rows):
        alone = kernels.paged_attention(q[r : r + 1], kv, tables[r : r + 1], torch.zeros(1, dtype=torch.int32),
                                        pos[r : r + 1], 0.125)
        assert torch.equal(alone, batch[r : r + 1])
    # a prompt's queries as one chunk (all rows share table 0) vs one at a time
    chunk_pos = torch.arange(40, dtype=torch.int32)
    qs = q[:1].expand(40, -1, -1).contiguous() + torch.linspace(0, 1, 40).view(40, 1, 1).to(dtype)
    chunk = kernels.paged_attention(qs, kv, tables[:1], torch.zeros(40, dtype=torch.int32), chunk_pos, 0.125)
    for t in range(40):
        one = kernels.paged_attention(qs[t : t + 1], kv, tables[:1], torch.zeros(1, dtype=torch.int32),
                                      chunk_pos[t : t + 1], 0.125)
        assert torch.equal(one, chunk[t : t + 1])


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("heads,hkv", [(9, 3), (4, 2), (2, 2), (8, 2)])
def test_the_fast_paths_give_the_generic_loops_bits(dname, heads, hkv):
    """Head size 64 in blocks of 16 takes a fast path (per ISA level: fp32 arithmetic over the paired
    bf16 layout in 8-lane slices without AVX512-BF16, dot products with it; fp32's own), which must
    give the bits of the loop every other shape takes (attend_row) where it claims to (AVX2, fp32):
    odd and even lengths, several blocks, G of 1 to 4. On AVX512-BF16 the dot products round their
    own way, so there the two are only close."""
    dtype, tol = DTYPES[dname]
    q, kv, tables, pos = _case(dtype, heads, hkv, 64, 16, rows=9, nb=9, seed=heads)
    pos[:3] = torch.tensor([0, 16, 143], dtype=torch.int32)
    rows = torch.arange(q.shape[0], dtype=torch.int32)
    fast = kernels.paged_attention(q, kv, tables, rows, pos, 0.125)
    kernels.attention_fast_paths(False)
    try:
        generic = kernels.paged_attention(q, kv, tables, rows, pos, 0.125)
    finally:
        kernels.attention_fast_paths(True)
    if dtype == torch.bfloat16 and kernels.attention_isa() != "fma":
        assert (fast.float() - generic.float()).abs().max().item() < tol
    else:
        assert torch.equal(fast, generic)


@pytest.mark.parametrize("heads,hkv", [(9, 3), (4, 2), (2, 2)])
def test_a_prompt_chunks_rows_taken_four_at_a_time_keep_each_rows_bits(heads, hkv):
    """bf16 rows of one table at consecutive positions run four at a time in one pass over their keys
    (attend_rows_bf16 on AVX512-BF16): every row must get the bits it gets alone, wherever the units
    fall (chunks starting at several offsets, odd and even lengths, across block edges), beside decode
    rows and another prompt's chunk, and the call must equal the one with units switched off."""
    dtype = torch.bfloat16
    q, kv, tables, _ = _case(dtype, heads, hkv, 64, 16, rows=4, nb=6)
    g = torch.Generator().manual_seed(5)
    for start in (0, 1, 3, 17):
        pos = torch.cat([torch.arange(start, start + 38), torch.tensor([70, 9]), torch.arange(0, 21)]).to(torch.int32)
        rt = torch.cat([torch.zeros(38), torch.tensor([2, 3]), torch.ones(21)]).to(torch.int32)
        qs = torch.randn(len(pos), heads, 64, generator=g).to(dtype)
        every = kernels.paged_attention(qs, kv, tables, rt, pos, 0.125)
        kernels.attention_row_units(False)
        try:
            assert torch.equal(kernels.paged_attention(qs, kv, tables, rt, pos, 0.125), every), start
        finally:
            kernels.attention_row_units(True)
        for r in range(len(pos)):
            alone = kernels.paged_attention(qs[r : r + 1], kv, tables[int(rt[r]) : int(rt[r]) + 1],
                                            torch.zeros(1, dtype=torch.int32), pos[r : r + 1], 0.125)
            assert torch.equal(alone, every[r : r + 1]), (start, r)


def test_only_keys_up_to_the_position_in_the_rows_own_table_are_read():
    """Poison (NaN) everything a row must not see: later slots of its last block, the blocks after
    it in its table, and every block of other rows' tables. Its output stays finite; poisoning a
    slot it does see makes only that row NaN."""
    q, kv, tables, pos = _case(torch.bfloat16, 9, 3, 64, 16, rows=4, nb=4)
    bs = 16
    pos = torch.tensor([20, 5, 47, 33], dtype=torch.int32)
    every = torch.arange(4, dtype=torch.int32)
    kvp = kv.clone()
    nan = torch.full((1, 3, 64), float("nan"), dtype=kv.dtype)

    def poison(block: int, offsets) -> None:
        for o in offsets:
            write_kv(kvp, torch.tensor([block * bs + o]), nan, nan)

    for r in range(4):
        p = int(pos[r])
        poison(int(tables[r, p // bs]), range(p % bs + 1, bs))
        for b in tables[r, p // bs + 1 :].tolist():
            poison(b, range(bs))
    clean = kernels.paged_attention(q, kv, tables, every, pos, 0.125)
    fenced = kernels.paged_attention(q, kvp, tables, every, pos, 0.125)
    assert torch.equal(clean, fenced)
    poison(int(tables[2, 0]), [3])  # a key row 2 does see
    hit = kernels.paged_attention(q, kvp, tables, every, pos, 0.125)
    assert torch.isnan(hit[2]).all() and not torch.isnan(hit[[0, 1, 3]]).any()
    # a prompt chunk's rows, sharing one table (AMX runs them as units of up to 16 (row, head)
    # queries): the slots after the chunk's last key are NaN too, and no row reads them
    kvp = kv.clone()
    for j in range(38, 64):
        poison(int(tables[0, j // bs]), [j % bs])
    cpos = torch.arange(38, dtype=torch.int32)
    qc = q[:1].expand(38, -1, -1).contiguous() + torch.linspace(0, 1, 38).view(38, 1, 1).to(q.dtype)
    zeros = torch.zeros(38, dtype=torch.int32)
    clean = kernels.paged_attention(qc, kv, tables[:1], zeros, cpos, 0.125)
    assert torch.equal(kernels.paged_attention(qc, kvp, tables[:1], zeros, cpos, 0.125), clean)


@pytest.mark.parametrize("dname", DTYPES)
def test_fused_row_ops_match_torch(dname):
    dtype, tol = DTYPES[dname]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    eps = 1e-5

    def ref_norm(t):
        tf = t.float()
        return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    assert (kernels.rms_norm(x, w, eps).float() - ref_norm(x).float()).abs().max() < tol * 4
    resid, delta = x.clone(), torch.randn(7, 576, generator=g).to(dtype)
    out = kernels.add_rms_norm_(resid, delta, w, eps)
    assert torch.equal(resid, x + delta)  # the residual stream, rounded as torch rounds it
    assert (out.float() - ref_norm(x + delta).float()).abs().max() < tol * 4

    gu = (3 * torch.randn(5, 2 * 1536, generator=g)).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert (kernels.silu_mul(gu).float() - (F.silu(gate) * up).float()).abs().max() < tol * 8

    for heads, dh in ((12, 64), (5, 40)):  # the models' head size, and one whose half is not 16 lanes
        width = (heads + 3) * dh
        qkv = torch.randn(6, width, generator=g).to(dtype)
        qkv[0, :5], qkv[1, :3] = 0.0, -0.0  # signed zeros: the rotated half is negated, not subtracted from 0
        positions = torch.tensor([0, 1, 7, 100, 511, 3])
        inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
        emb = torch.cat([torch.outer(torch.arange(512).float(), inv)] * 2, dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        rotated = qkv.clone()
        kernels.rope_(rotated, cos, sin, positions, heads, dh)
        xs = qkv[:, : heads * dh].view(6, heads, dh)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        ref = xs * c + torch.cat([-xs[..., dh // 2 :], xs[..., : dh // 2]], dim=-1) * s
        got = rotated[:, : heads * dh].view(6, heads, dh)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), ref.view(bits)), dh  # torch's three roundings, bit for bit
        assert torch.equal(rotated[:, heads * dh :], qkv[:, heads * dh :])  # v untouched


def test_build_failure_is_a_clear_error(tmp_path):
    with pytest.raises(kernels.BuildError, match="no C"):
        kernels.build(cxx=str(tmp_path / "no-such-g++"), cache_dir=tmp_path)


def test_without_a_compiler_the_engine_runs_the_torch_path(tmp_path, tiny_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = ("import sys; from isolab.llm import LLM; from isolab.sampling_params import SamplingParams as S; "
            "llm = LLM(model=sys.argv[1], dtype='bf16'); assert not llm.engine.model.native_kernels; "
            "print(llm.generate([[5, 6, 7]], S(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "native kernels unavailable" in out.stderr and "no C++ compiler" in out.stderr


@pytest.mark.parametrize("dname", DTYPES)
def test_fused_write_equals_write_kv_then_attend(dname):
    """The kernel's own K/V write (rows of the qkv buffer, into slots) lands the same bytes as
    llama.write_kv, and a prompt chunk's rows see the keys written in the same call."""
    dtype, _ = DTYPES[dname]
    heads, hkv, dh, bs, n = 9, 3, 64, 16, 37
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(n, (heads + 2 * hkv) * dh, generator=g).to(dtype)
    q = qkv[:, : heads * dh].view(n, heads, dh)
    k = qkv[:, heads * dh : (heads + hkv) * dh].view(n, hkv, dh)
    v = qkv[:, (heads + hkv) * dh :].view(n, hkv, dh)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])
    pos = torch.arange(n, dtype=torch.int32)
    rows = torch.zeros(n, dtype=torch.int32)
    fused_pool = torch.zeros(2, hkv, 8, bs, dh, dtype=dtype)
    fused = kernels.paged_attention(q, fused_pool, table, rows, pos, 0.125, new_kv=(k, v, slots))
    pool = torch.zeros(2, hkv, 8, bs, dh, dtype=dtype)
    write_kv(pool, slots, k, v)
    assert torch.equal(fused_pool, pool)
    assert torch.equal(fused, kernels.paged_attention(q.contiguous(), pool, table, rows, pos, 0.125))


@pytest.mark.parametrize("heads,hkv,dh,window", [(9, 3, 64, 0), (8, 2, 256, 0), (9, 3, 64, 40), (4, 1, 256, 24)])
def test_every_prefetch_level_gives_the_same_bits(heads, hkv, dh, window):
    """The bf16 kernel prefetches scattered blocks and the next task's keys (claimed one task ahead
    while many are left): each level reads the same keys in the same order, every (row, head) task
    runs once, and a window's first block is where the next task's prefetch starts. (Without
    AVX512-BF16 or AMX, the fma kernel's bf16 path prefetches within its task for 64-dim heads.)"""
    q, kv, tables, pos = _case(torch.bfloat16, heads, hkv, dh, 16, rows=24, nb=5)
    outs = []
    for rows in (24, 3, 1):  # many tasks, and fewer than the threads' claim-ahead margin
        every = torch.arange(rows, dtype=torch.int32)
        per_level = []
        try:
            for level in (0, 1, 2):
                kernels.attention_prefetch(level)
                per_level.append(kernels.paged_attention(q[:rows], kv, tables[:rows], every, pos[:rows], dh**-0.5,
                                                         window=window))
        finally:
            kernels.attention_prefetch(2)
        assert torch.equal(per_level[0], per_level[1]) and torch.equal(per_level[0], per_level[2])
        outs.append(per_level[2])
    assert torch.equal(outs[1], outs[0][:3]) and torch.equal(outs[2], outs[0][:1])
    if window == 0:
        ref = _torch_reference(q, kv, tables, pos)
        assert (outs[0].float() - ref.float()).abs().max().item() < DTYPES["bf16"][1]


@pytest.mark.skipif(not kernels.native_ready() or not shutil.which("objdump"),
                    reason="no native kernels, or no objdump to read the build")
def test_the_key_prefetch_reaches_the_binary():
    """The within-task prefetch sends K runs into L1 (prefetcht0) and V runs into L2 (prefetcht1), in
    every build (the AVX512-BF16, AMX and fma kernels' bf16 paths).
    GCC 12 deletes a call to a function whose only work is prefetches (it finds it "const") before
    inlining it, and the K half of the first version never reached the binary; TaskPrefetch is
    always_inline. Bits cannot show a prefetch, so this reads the built library."""
    path = kernels._library()._name  # type: ignore[union-attr]
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                         timeout=120).stdout
    assert "prefetcht0" in asm and "prefetcht1" in asm


@pytest.mark.parametrize("dname", DTYPES)
def test_argmax_rows_gives_torch_argmax(dname):
    """The sampler's greedy pick: the first NaN if a row has one, else the first maximum, ties and
    signed zeros as torch decides them, whatever the row length (the 16-lane and 64-value steps
    and their tails)."""
    dtype, _ = DTYPES[dname]
    g = torch.Generator().manual_seed(3)
    for trial in range(240):
        m, v = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g))
        x = torch.randn(m, v, generator=g)
        where = torch.rand(m, v, generator=g)
        kind = trial % 6
        if kind == 1:
            x = (x * 2).round()  # many ties
        elif kind == 2:
            x[where < 0.05] = float("nan")
        elif kind == 3:
            x[:] = float("-inf")
            x[where < 0.1] = -0.0
        elif kind == 4:
            x = torch.where(where < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
        elif kind == 5:
            x[where < 0.2] = float("inf")
        x = x.to(dtype)
        assert torch.equal(kernels.argmax_rows(x), torch.argmax(x, dim=-1)), (kind, m, v)
    wide = torch.randn(3, 49152, generator=g).to(dtype)  # a vocabulary's width, and a row view
    assert torch.equal(kernels.argmax_rows(wide[1:]), torch.argmax(wide[1:], dim=-1))


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("f", [2, 4])
def test_a_block_of_16_f_keys_is_f_blocks_of_16(dname, f):
    """A block size that is a multiple of 16 lays each block out as f 16-key blocks, in the pool
    (write_kv and the kernel's own writes agree) and to the kernel, which then runs its fast paths
    on them: the bits are those of block size 16, whatever the path this CPU takes."""
    dtype, _ = DTYPES[dname]
    heads, hkv, dh, rows, nb = 9, 3, 64, 8, 3
    bs = 16 * f
    g = torch.Generator().manual_seed(f)
    num_blocks = rows * nb + 1
    slots = torch.arange(bs, num_blocks * bs)
    k = torch.randn(len(slots), hkv, dh, generator=g).to(dtype)
    v = torch.randn(len(slots), hkv, dh, generator=g).to(dtype)
    big = torch.zeros(2, hkv, num_blocks, bs, dh, dtype=dtype)
    small = torch.zeros(2, hkv, num_blocks * f, 16, dh, dtype=dtype)
    write_kv(big, slots, k, v)
    write_kv(small, slots, k, v)  # slot b bs + o is slot (b f + o // 16) 16 + o % 16: the same number
    assert torch.equal(big.flatten(), small.flatten())
    tables = (torch.randperm(num_blocks - 1, generator=g)[: rows * nb] + 1).view(rows, nb).to(torch.int32)
    tables16 = (tables.view(rows, nb, 1) * f + torch.arange(f, dtype=torch.int32)).view(rows, nb * f)
    pos = torch.randint(0, nb * bs, (rows,), generator=g).to(torch.int32)
    q = torch.randn(rows, heads, dh, generator=g).to(dtype)
    every = torch.arange(rows, dtype=torch.int32)
    assert torch.equal(kernels.paged_attention(q, big, tables, every, pos, 0.125),
                       kernels.paged_attention(q, small, tables16, every, pos, 0.125))
    # the kernel's own writes (a decode row's new K/V) land where write_kv puts them
    n = 3 * bs + 5
    new = slots[:n]
    qkv = torch.cat([q[:1].expand(n, -1, -1), k[:n], v[:n]], dim=1).reshape(n, -1)  # one (N, W) buffer, as the GEMM's
    kq, kk, kv_ = (qkv[:, a * dh:b * dh].view(n, -1, dh) for a, b in ((0, heads), (heads, heads + hkv),
                                                                      (heads + hkv, heads + 2 * hkv)))
    kernel_pool = torch.zeros_like(big)
    kernels.paged_attention(kq, kernel_pool, tables[:1], torch.zeros(n, dtype=torch.int32),
                            torch.zeros(n, dtype=torch.int32), 0.125, new_kv=(kk, kv_, new))
    ref_pool = torch.zeros_like(big)
    write_kv(ref_pool, new, k[:n], v[:n])
    assert torch.equal(kernel_pool, ref_pool)
