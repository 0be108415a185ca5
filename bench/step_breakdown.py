"""Where a decode step of 32 rows spends its time (docs/engine.md, README "How the 32-request
figure got to 2x"), on the real model:

  gemm        the 30 layers' four GEMMs plus the LM head at M = 32 (and 512, for GFLOP/s),
              the engine's GEMM path (isolab's own GEMM, models/linear.py) against F.linear on
              the same weights, warm
  native      one engine step (all 32 requests decoding) on the native path, split into GEMMs,
              paged attention, the fused row ops and the rest
  torch       the same step on the torch path (attention = gather + attention_core)

    .venv/bin/python bench/step_breakdown.py [--dtype bf16] [--repeats 20]

Writes bench/results/step_breakdown_DTYPE.json. Run it alone (2 cores): figures are medians.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import isolab.kernels as kernels  # noqa: E402
import isolab.models.llama as llama  # noqa: E402
from isolab.bench.workload import WorkloadSpec, make_workload  # noqa: E402
from isolab.config import EngineConfig  # noqa: E402
from isolab.engine.llm_engine import LLMEngine  # noqa: E402
from isolab.engine.model_runner import PagedAttention  # noqa: E402
from isolab.models.bundle import load_bundle  # noqa: E402
from isolab.models.gguf_loader import load_gguf  # noqa: E402
from isolab.models.linear import Weight  # noqa: E402
from isolab.sampling_params import SamplingParams  # noqa: E402

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536)}
HEAD = (49152, 576)


def gemm_step_ms(dtype: torch.dtype, repeats: int, rows: int = 32) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    out = {"packed": 0.0, "F.linear": 0.0}
    flop = 0.0
    for (n, k), times in [(s, 30) for s in SHAPES.values()] + [(HEAD, 1)]:
        flop += 2.0 * rows * n * k * times
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        packed = Weight(w, "isolab")
        for name, fn in (("packed", lambda p=packed, x=x: p(x)), ("F.linear", lambda x=x, w=w: F.linear(x, w))):
            fn()
            samples = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
            out[name] += statistics.median(samples) * 1e3 * times
    out["packed_gflops"] = flop / out["packed"] / 1e6
    return out


def step_ms(dtype: str, native: bool, repeats: int) -> dict[str, float]:
    bundle = load_bundle(None, dtype)
    if bundle.model.native_kernels != native:
        model = llama.LlamaModel(load_gguf(str(bundle.path)), dtype, "cpu", native=native)
        bundle = dataclasses.replace(bundle, model=model)
    engine = LLMEngine(EngineConfig(dtype=dtype), bundle)
    wl = make_workload(WorkloadSpec(num_requests=32, prompt_len=(16, 64), output_len=(128, 128)))
    for i, p in enumerate(wl.prompts):
        engine.add_request(f"r{i}", engine.tokenizer.encode(p), SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    for _ in range(64):  # prompts done, 32 rows decoding
        engine.step()
    out = engine.scheduler.schedule()
    assert len(out.chunks) == 32 and all(c.num_new_tokens == 1 for c in out.chunks)
    spent: dict[str, list[float]] = collections.defaultdict(list)
    acc: dict[str, float] = collections.defaultdict(float)
    patched = []

    def wrap(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            acc[key] += time.perf_counter() - t
            return r
        patched.append((obj, name, fn))
        setattr(obj, name, timed)

    wrap(Weight, "__call__", "gemm")
    wrap(PagedAttention, "attend", "attention")
    for name in ("rms_norm", "add_rms_norm_", "silu_mul", "rope_"):
        wrap(kernels, name, "row_ops")
    try:
        for _ in range(repeats):
            acc.clear()
            t = time.perf_counter()
            engine.runner.execute(out)
            spent["execute"].append(time.perf_counter() - t)
            for key in ("gemm", "attention", "row_ops"):
                spent[key].append(acc[key])
    finally:
        for obj, name, fn in patched:
            setattr(obj, name, fn)
        engine.close()
    res = {k: statistics.median(v) * 1e3 for k, v in spent.items()}
    res["rest"] = res["execute"] - res["gemm"] - res["attention"] - res["row_ops"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    tdtype = llama.TORCH_DTYPES[a.dtype]
    result = {"dtype": a.dtype, "rows": 32, "gemm_ms_per_step": gemm_step_ms(tdtype, a.repeats),
              "gemm_512_rows": gemm_step_ms(tdtype, max(3, a.repeats // 4), rows=512),
              "native_step_ms": step_ms(a.dtype, True, a.repeats), "torch_step_ms": step_ms(a.dtype, False, a.repeats)}
    g = result["gemm_ms_per_step"]
    g512 = result["gemm_512_rows"]
    print(f"GEMMs of one step at M = 32 ({a.dtype}, warm): isolab {g['packed']:.1f} ms ({g['packed_gflops']:.0f} GFLOP/s), "
          f"F.linear {g['F.linear']:.1f} ms; at M = 512: isolab {g512['packed_gflops']:.0f} GFLOP/s")
    for path in ("native", "torch"):
        s = result[f"{path}_step_ms"]
        print(f"{path:6} step: execute {s['execute']:.1f} ms = GEMMs {s['gemm']:.1f} + attention {s['attention']:.1f} "
              f"+ row ops {s['row_ops']:.1f} + rest {s['rest']:.1f}")
    out = Path(__file__).parent / "results" / f"step_breakdown_{a.dtype}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
