"""Throughput as load grows (issue 14): the engine at each concurrency, one process, one model.

For each concurrency C: 2*C requests (prompts of 64-256 words, 128 new tokens, greedy, ignore_eos)
through LLMEngine with at most C in flight (isolab/bench/engine_bench.py), with the engine
defaults a user gets. The GEMM share of a step at C rows is bench/step_profile.py's.

    .venv/bin/python bench/concurrency.py [--concurrency 1,8,32,128,256] [--dtype bf16] [--kv-cache-dtype int8]
        [--max-num-batched-tokens N] [--max-prefill-tokens N]

Writes bench/results/concurrency_DTYPE[_kvint8].json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab.bench.engine_bench import run_engine_bench  # noqa: E402
from isolab.bench.workload import WorkloadSpec, make_workload  # noqa: E402
from isolab.config import build_engine_config  # noqa: E402
from isolab.engine.llm_engine import LLMEngine  # noqa: E402
from isolab.models.bundle import load_bundle  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32,128,256")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--weights", default="auto", choices=("auto", "native", "dense"))
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens a step computes (the engine's default when not given)")
    ap.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="prompt tokens a step computes at most (default: no cap besides the step's budget)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bundle = load_bundle(None, args.dtype, weights=args.weights)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        # the defaults a user gets (the K/V pool's dtype as asked)
        budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
        if args.max_prefill_tokens is not None:
            budget["max_prefill_tokens"] = args.max_prefill_tokens
        engine = LLMEngine(build_engine_config(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, **budget), bundle)
        wl = make_workload(WorkloadSpec(num_requests=max(2 * c, 4), prompt_len=(64, 256), output_len=(128, 128),
                                        seed=c))
        r = run_engine_bench(engine, wl, c)
        engine.close()
        rows.append(r)
        print(f"C={c:4d}  {r['output_tokens_per_s']:7.1f} tok/s  ITL p50 {r['itl_s']['p50'] * 1e3:6.1f} ms  "
              f"p99 {r['itl_s']['p99'] * 1e3:6.1f} ms  TTFT p50 {r['ttft_s']['p50']:.2f} s  "
              f"preemptions {r['preemptions']}", flush=True)
    kv = "" if args.kv_cache_dtype == "auto" else f"_kv{args.kv_cache_dtype}"
    out = Path(args.out or Path(__file__).parent / "results" / f"concurrency_{args.dtype}{kv}.json")
    out.write_text(json.dumps({"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "weights": bundle.weights,
                               "numerics": bundle.model.numerics.numerics,
                               "max_num_batched_tokens": args.max_num_batched_tokens or "default",
                               "max_prefill_tokens": args.max_prefill_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
