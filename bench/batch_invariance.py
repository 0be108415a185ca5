"""Measures which ops give a row other bits depending on the batch, on this CPU (docs/numerics.md).

For each GEMM shape of SmolLM2-135M and each dtype: compute 512 rows at once, then in slices of
M rows, and count output elements whose bits differ. Prints a table, writes JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.models.llama import Weight, attention_core, write_kv  # noqa: E402

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536), "lm_head": (49152, 576)}
SLICES = (1, 2, 3, 4, 5, 8, 9, 17, 64)


def gemm_mismatches(dtype: torch.dtype, n: int, k: int, make) -> dict[int, int]:
    """make(weight) -> fn(x): the op under test with its weight bound (packed once, if it packs)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(256 if n > 10000 else 512, k, generator=g).to(dtype)
    fn = make(w)
    ref = fn(x)
    out = {}
    for m in SLICES:
        bad = 0
        for s in range(0, x.shape[0] - m + 1, m):
            bad += int((fn(x[s : s + m]) != ref[s : s + m]).sum())
        out[m] = bad
    return out


def attention_mismatches(dtype: torch.dtype, native: bool) -> dict[str, int]:
    """Attention (SmolLM2 heads: 3 KV heads, 9 query heads, Dh 64) on the same queries and keys
    grouped three ways: 32 decode rows at once vs each alone, keys padded vs exact, and 40 prompt
    queries in one chunk vs one at a time (what preemption and prefix hits rely on). `native`:
    isolab's kernel reading a paged pool; else attention_core over gathered keys (the torch path)."""
    g = torch.Generator().manual_seed(0)
    hkv, heads, dh, b, s, bs = 3, 9, 64, 32, 160, 16
    q = torch.randn(b, 1, heads, dh, generator=g).to(dtype)
    k = torch.randn(hkv, b, s, dh, generator=g).to(dtype)
    v = torch.randn(hkv, b, s, dh, generator=g).to(dtype)
    pos = torch.randint(40, 150, (b, 1), generator=g)
    if native:  # the same keys in a pool: row i's table is blocks i*nb+1 .. (i+1)*nb
        nb = s // bs
        pool = torch.zeros(2, hkv, b * nb + 1, bs, dh, dtype=dtype)
        slots = torch.arange(bs, (b * nb + 1) * bs)
        write_kv(pool, slots, k.permute(1, 2, 0, 3).reshape(-1, hkv, dh), v.permute(1, 2, 0, 3).reshape(-1, hkv, dh))
        tables = (torch.arange(b * nb, dtype=torch.int32) + 1).view(b, nb)

        def attend(qs, rows, p, width):  # width: keys the table covers (the padding analogue)
            t = tables[rows][:, : -(-width // bs)].contiguous()
            out = kernels.paged_attention(qs.view(-1, heads, dh), pool, t,
                                          torch.arange(len(rows), dtype=torch.int32).repeat_interleave(qs.shape[1]),
                                          p.view(-1).to(torch.int32), dh**-0.5)
            return out.view(qs.shape)
    else:
        def attend(qs, rows, p, width):
            return attention_core(qs, k[:, rows, :width], v[:, rows, :width], p, dh**-0.5)
    full = attend(q, list(range(b)), pos, s)
    batch = padded = 0
    for i in range(b):
        one = slice(i, i + 1)
        batch += int((attend(q[one], [i], pos[one], s) != full[one]).sum())
        n = -(-(int(pos[i]) + 1) // 16) * 16
        padded += int((attend(q[one], [i], pos[one], n) != full[one]).sum())
    t = 40
    qq = torch.randn(1, t, heads, dh, generator=g).to(dtype)
    tpos = torch.arange(t).view(1, t)
    chunk = attend(qq, [0], tpos, 48)
    split = sum(int((attend(qq[:, j : j + 1], [0], tpos[:, j : j + 1], 48) != chunk[:, j : j + 1]).sum())
                for j in range(t))
    return {"batch_vs_solo": batch, "padded_vs_exact": padded, "chunk_vs_one_by_one": split}


def main() -> None:
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "gemm": {}}
    print(f"{'shape':10} {'dtype':5} {'op':12} " + " ".join(f"M={m:<6}" for m in SLICES))
    for name, (n, k) in SHAPES.items():
        for dname, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for opname, make in (("F.linear", lambda w: lambda x: F.linear(x, w)), ("isolab", Weight)):
                r = gemm_mismatches(dt, n, k, make)
                result["gemm"][f"{name}/{dname}/{opname}"] = r
                print(f"{name:10} {dname:5} {opname:12} " + " ".join(f"{r[m]:<8}" for m in SLICES))
    result["attention"] = {}
    print(f"\n{'attention':14} {'dtype':5} {'32 rows vs 1':14} {'padded keys':12} {'40-query chunk vs 1 by 1'}")
    for path, native in (("torch", False), ("native", True)):
        if native and not kernels.available(torch.device("cpu"), torch.bfloat16, 9, 3, 64):
            continue
        for dname, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = result["attention"][f"{path}/{dname}"] = attention_mismatches(dt, native)
            print(f"{path:14} {dname:5} {a['batch_vs_solo']:<14} {a['padded_vs_exact']:<12} {a['chunk_vs_one_by_one']}")
    out = Path(__file__).parent / "results" / "batch_invariance.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
