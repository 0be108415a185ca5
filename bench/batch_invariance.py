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
from isolab.models.llama import linear  # noqa: E402

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536), "lm_head": (49152, 576)}
SLICES = (1, 2, 3, 4, 5, 8, 9, 17, 64)


def gemm_mismatches(dtype: torch.dtype, n: int, k: int, fn) -> dict[int, int]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(256 if n > 10000 else 512, k, generator=g).to(dtype)
    ref = fn(x, w)
    out = {}
    for m in SLICES:
        bad = 0
        for s in range(0, x.shape[0] - m + 1, m):
            bad += int((fn(x[s : s + m], w) != ref[s : s + m]).sum())
        out[m] = bad
    return out


def main() -> None:
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "gemm": {}}
    print(f"{'shape':10} {'dtype':5} {'op':12} " + " ".join(f"M={m:<6}" for m in SLICES))
    for name, (n, k) in SHAPES.items():
        for dname, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for opname, fn in (("F.linear", F.linear), ("isolab", linear)):
                if dname == "fp32" and opname == "isolab" and name == "lm_head":
                    continue
                r = gemm_mismatches(dt, n, k, fn)
                result["gemm"][f"{name}/{dname}/{opname}"] = r
                print(f"{name:10} {dname:5} {opname:12} " + " ".join(f"{r[m]:<8}" for m in SLICES))
    out = Path(__file__).parent / "results" / "batch_invariance.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
