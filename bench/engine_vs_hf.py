"""isolab's engine against transformers' static-batch generate, repeated and interleaved (issue 3's
throughput target): 32 concurrent requests x 128 new tokens, prompts 16-64 words, per dtype.

Each repeat runs a fresh engine (empty prefix cache), then transformers, on the same prompts in
the same process; the ratio of each pair is reported, and their median is the figure. The machine
is shared and noisy, so one pair can be off by 15% either way; the median of pairs is what README
quotes.

    .venv/bin/python bench/engine_vs_hf.py [--repeats 3] [--dtypes bf16,fp32]

Writes bench/results/engine_vs_hf.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.bench.engine_bench import load_hf, run_engine_bench, run_hf_bench  # noqa: E402
from isolab.bench.workload import WorkloadSpec, make_workload  # noqa: E402
from isolab.config import EngineConfig  # noqa: E402
from isolab.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    wl = make_workload(WorkloadSpec(num_requests=a.concurrency, prompt_len=(16, 64), output_len=(128, 128)))
    result: dict = {"workload": vars(wl.spec), "machine": {"cpu": platform.processor() or platform.machine(),
                                                         "torch_threads": torch.get_num_threads()}, "dtypes": {}}
    for dtype in a.dtypes.split(","):
        hf = load_hf(None, dtype)
        pairs = []
        for r in range(a.repeats):
            engine = LLMEngine(EngineConfig(dtype=dtype))  # a fresh, empty prefix cache every repeat
            ours = run_engine_bench(engine, wl, a.concurrency)
            engine.close()
            theirs = run_hf_bench(None, dtype, wl, a.concurrency, loaded=hf)
            ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
            pairs.append({"isolab": ours, "hf": theirs, "ratio": ratio})
            print(f"{dtype} repeat {r + 1}: isolab {ours['output_tokens_per_s']:.1f} tok/s "
                  f"(ITL p50 {ours['itl_s']['p50'] * 1e3:.1f} ms), transformers {theirs['output_tokens_per_s']:.1f} "
                  f"tok/s: {ratio:.2f}x", flush=True)
        ratios = [p["ratio"] for p in pairs]
        result["dtypes"][dtype] = {
            "native_kernels": engine.model.native_kernels,
            "prefix_cache_hit_rate_max": max(p["isolab"]["prefix_cache_hit_rate"] for p in pairs),
            "isolab_tok_s_median": statistics.median(p["isolab"]["output_tokens_per_s"] for p in pairs),
            "hf_tok_s_median": statistics.median(p["hf"]["output_tokens_per_s"] for p in pairs),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "pairs": pairs,
        }
        d = result["dtypes"][dtype]
        print(f"{dtype}: median ratio {d['ratio_median']:.2f}x (min {d['ratio_min']:.2f}, max {d['ratio_max']:.2f}); "
              f"isolab {d['isolab_tok_s_median']:.0f} tok/s, transformers {d['hf_tok_s_median']:.0f} tok/s", flush=True)
        del hf
    result["native_kernels_available"] = kernels.available(torch.device("cpu"), torch.bfloat16, 9, 3, 64)
    out = Path(__file__).parent / "results" / "engine_vs_hf.json"
    if out.exists():  # a run of some dtypes keeps the others' last figures
        kept = json.loads(out.read_text()).get("dtypes", {})
        result["dtypes"] = {**{k: v for k, v in kept.items() if k not in result["dtypes"]}, **result["dtypes"]}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
