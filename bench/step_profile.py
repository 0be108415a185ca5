"""Where a step's time goes at each batch size (issue 14's profile tool), on the real model.

For each concurrency N: N requests (prompts of `--prompt-len` words) are admitted and prefilled,
then `--steps` decode steps of N rows are profiled (isolab/bench/profile.py: schedule, input
preparation, each GEMM, attention, row ops, sampling, update, other), and the same N rows'
output detokenized as the server would (Detokenizer.push per token, timed apart).
The GEMM-bound rate is N / (GEMM ms per step): what the step would give if GEMMs were all.
The timers run the model layer by layer (Python's timers cannot reach inside the one-call native
forward), so each timed step is followed by an untimed one, as the engine runs it:
`plain_decode_tok_per_s` and its share of the GEMM-bound rate are what a user gets, and
`plain_forward_ms_per_step` is that forward's own per-op clock (forward.cpp), summed over layers.

    .venv/bin/python bench/step_profile.py [--concurrency 1,8,32,128] [--dtype bf16] [--steps 12]
        [--weights native] [--attention-prefetch 0,2 --rounds 3] [--paired-prefetch-ab 60]
        [--paired-order-ab 60] [--paired-tiles-ab 60]

Writes bench/results/step_profile_DTYPE.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.bench.profile import StepProfiler  # noqa: E402
from isolab.bench.workload import WorkloadSpec, make_workload  # noqa: E402
from isolab.config import MiB, build_engine_config  # noqa: E402
from isolab.engine.detokenize import Detokenizer  # noqa: E402
from isolab.engine.llm_engine import LLMEngine  # noqa: E402
from isolab.models.bundle import load_bundle  # noqa: E402
from isolab.sampling_params import SamplingParams  # noqa: E402

PHASES = ("schedule", "prepare", "gemm", "attention", "row_ops", "sample", "update", "other")
KV_CACHE_DTYPE = ["auto"]  # the engines' pool dtype (--kv-cache-dtype), set once by main


def decoding_engine(bundle, dtype: str, n: int, prompt_words: tuple[int, int], max_tokens: int):
    """An engine with n requests admitted, prefilled and decoding (two warm steps): (engine, detokenizers)."""
    engine = LLMEngine(build_engine_config(dtype=dtype, weights=bundle.weights, max_num_seqs=max(n, 1), kv_cache_memory=4096 * MiB,
                                           max_num_batched_tokens=2048, kv_cache_dtype=KV_CACHE_DTYPE[0]), bundle)
    wl = make_workload(WorkloadSpec(num_requests=n, prompt_len=prompt_words, output_len=(128, 128), seed=n))
    detoks = {}
    for i, p in enumerate(wl.prompts):
        engine.add_request(f"r{i}", engine.tokenizer.encode(p), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                                ignore_eos=True))
        detoks[f"r{i}"] = Detokenizer(engine.tokenizer)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefill (and a few first tokens)
    for _ in range(2):
        engine.step()  # warm
    return engine, detoks


def paired_ab(bundle, dtype: str, n: int, prompt_words: tuple[int, int], steps: int,
              switch: Callable[[bool], object]) -> dict:
    """Untimed decode steps of one engine, `switch` turned off and on from one step to the next
    (the attention prefetch: levels 0 and 2; the GEMM's order: chunk by chunk and the default):
    the machine's drift falls on both sides alike. Saving: off minus on."""
    engine, _ = decoding_engine(bundle, dtype, n, prompt_words, 2 * steps + 64)
    ms: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i in range(2 * steps):
            on = i % 2 == 1
            switch(on)
            t0 = time.perf_counter()
            engine.step()
            ms[on].append((time.perf_counter() - t0) * 1e3)
    finally:
        switch(True)
        engine.close()
    diff = [a - b for a, b in zip(ms[False], ms[True], strict=True)]
    return {"concurrency": n, "steps_each": steps, "median_step_ms": {"off": statistics.median(ms[False]),
                                                                      "on": statistics.median(ms[True])},
            "median_paired_saving_ms": statistics.median(diff), "mean_paired_saving_ms": statistics.mean(diff),
            "step_ms": {"off": ms[False], "on": ms[True]}}


def profile_at(bundle, dtype: str, n: int, prompt_words: tuple[int, int], steps: int) -> dict:
    engine, detoks = decoding_engine(bundle, dtype, n, prompt_words, 2 * steps + 64)
    # Each timed step is followed by an untimed one, as the engine runs it (the one-call forward where
    # the model has one; the timers run the model layer by layer to time each phase): the two
    # figures are taken side by side, so the machine's drift moves both.
    prof = StepProfiler(engine)
    detok_s = wall = plain_wall = 0.0

    def detokenize(outs) -> float:
        t = time.perf_counter()
        for o in outs:
            detoks[o.request_id].push(o.new_token_ids)
        return time.perf_counter() - t

    kernels.forward_profile(True)  # the untimed steps' one-call forward times its own ops
    for _ in range(steps):
        with prof:
            t0 = time.perf_counter()
            outs = engine.step()
        detok_s += detokenize(outs)
        wall += time.perf_counter() - t0
        t0 = time.perf_counter()
        detokenize(engine.step())
        plain_wall += time.perf_counter() - t0
    native = kernels.forward_profile(False) or {}
    ms = prof.report()
    engine.close()
    ms["detokenize"] = detok_s * 1e3 / steps
    return {
        "concurrency": n, "rows_per_step": n, "ms_per_step": ms,
        "decode_tok_per_s": n * steps / wall,
        "gemm_share": ms["gemm"] / ms["step"],
        "gemm_bound_tok_per_s": n / (ms["gemm"] / 1e3),
        "plain_ms_per_step": plain_wall * 1e3 / steps,
        "plain_decode_tok_per_s": n * steps / plain_wall,
        "plain_share_of_gemm_bound": (n * steps / plain_wall) / (n / (ms["gemm"] / 1e3)),
        # inside the one-call forward of the untimed steps (forward.cpp's own clocks; empty where the
        # model runs layer by layer): ms a step per op, summed over the layers
        "plain_forward_ms_per_step": {k: v / steps for k, v in native.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--weights", default="auto", choices=("auto", "native", "dense"))
    ap.add_argument("--prompt-len", default="64:256", help="prompt words LO:HI")
    ap.add_argument("--attention-prefetch", default="2",
                    help="the attention kernel's prefetch levels to run, alternating (0 none, 1 within a task, 2 also "
                         "the next task: the default; bench/attention_prefetch.py)")
    ap.add_argument("--rounds", type=int, default=1, help="with several levels: how many times to alternate them")
    ap.add_argument("--paired-prefetch-ab", type=int, default=0, metavar="STEPS",
                    help="instead of profiling: STEPS untimed steps at each prefetch level 0 and 2, switched every step "
                         "(writes step_profile_prefetch_paired.json)")
    ap.add_argument("--paired-order-ab", type=int, default=0, metavar="STEPS",
                    help="instead of profiling: STEPS untimed steps with the quantized GEMM's big-weight task order "
                         "and prefetch off and on, switched every step (writes step_profile_qgemm_order_paired.json)")
    ap.add_argument("--paired-tiles-ab", type=int, default=0, metavar="STEPS",
                    help="instead of profiling: STEPS untimed steps with the quantized GEMM's tiles of 4 rows and its "
                         "default (8 on AVX-512 VNNI, 3 on AVX2), switched every step "
                         "(writes step_profile_qgemm_tiles_paired.json)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    KV_CACHE_DTYPE[0] = args.kv_cache_dtype
    lo, _, hi = args.prompt_len.partition(":")
    bundle = load_bundle(None, args.dtype, weights=args.weights)
    levels = [int(x) for x in args.attention_prefetch.split(",")]
    if (levels != [2] or args.paired_prefetch_ab) and not kernels.attention_prefetch(2):
        print("--attention-prefetch / --paired-prefetch-ab: the prefetches are in the native attention kernels, "
              "which do not run here")
        return 2
    if args.paired_order_ab and (bundle.weights != "native" or not kernels.qgemm_order(True)):
        print("--paired-order-ab: the task order is the quantized GEMM's, which runs with native weights only")
        return 2
    if args.paired_tiles_ab and (bundle.weights != "native" or kernels.qgemm_default_tile_rows() in (0, 4)):
        print("--paired-tiles-ab: compares the quantized GEMM's default tiles with tiles of 4 rows, so it needs "
              "native weights and a build whose default is not 4 rows (AVX-512 VNNI's 8, AVX2's 3)")
        return 2
    for steps, switch, name, what in (
            (args.paired_prefetch_ab, lambda on: kernels.attention_prefetch(2 if on else 0), "prefetch",
             "attention prefetch 0 / 2"),
            (args.paired_order_ab, kernels.qgemm_order, "qgemm_order",
             "qgemm chunk by chunk / big weights by group, next panels prefetched"),
            (args.paired_tiles_ab, lambda on: kernels.qgemm_tile_rows(0 if on else 4), "qgemm_tiles",
             f"qgemm tiles of 4 rows / of {kernels.qgemm_default_tile_rows()}")):
        if not steps:
            continue
        pairs = []
        for n in (int(x) for x in args.concurrency.split(",")):
            r = paired_ab(bundle, args.dtype, n, (int(lo), int(hi or lo)), steps, switch)
            pairs.append(r)
            print(f"N={n:4d}  untimed step, median ({what}): {r['median_step_ms']['off']:.1f} ms / "
                  f"{r['median_step_ms']['on']:.1f} ms; paired saving median {r['median_paired_saving_ms']:.2f} ms, "
                  f"mean {r['mean_paired_saving_ms']:.2f}", flush=True)
        out = Path(args.out or Path(__file__).parent / "results" / f"step_profile_{name}_paired.json")
        out.write_text(json.dumps({"dtype": args.dtype, "weights": bundle.weights, "switch": what, "rows": pairs},
                                  indent=2))
        print(f"wrote {out}")
        return 0
    rows = []
    try:
        for n in (int(x) for x in args.concurrency.split(",")):
            for _ in range(args.rounds if len(levels) > 1 else 1):
                for level in levels:
                    kernels.attention_prefetch(level)
                    r = profile_at(bundle, args.dtype, n, (int(lo), int(hi or lo)), args.steps)
                    r["attention_prefetch"] = level
                    rows.append(r)
                    ms = r["ms_per_step"]
                    parts = "  ".join(f"{p} {ms.get(p, 0.0):6.1f}" for p in PHASES)
                    gemms = "  ".join(f"{k[5:]} {v:.1f}" for k, v in sorted(ms.items()) if k.startswith("gemm."))
                    tag = f"  prefetch {level}" if len(levels) > 1 else ""
                    print(f"N={n:4d}{tag}  step {ms['step']:7.1f} ms  {r['decode_tok_per_s']:7.1f} tok/s  GEMM share "
                          f"{r['gemm_share']:.0%}  GEMM-bound {r['gemm_bound_tok_per_s']:7.0f} tok/s\n"
                          f"        untimed: step {r['plain_ms_per_step']:7.1f} ms  {r['plain_decode_tok_per_s']:7.1f} tok/s  "
                          f"{r['plain_share_of_gemm_bound']:.0%} of GEMM-bound\n"
                          f"        {parts}  detok {ms['detokenize']:.2f}\n        GEMMs: {gemms}", flush=True)
                    if r["plain_forward_ms_per_step"]:
                        inside = "  ".join(f"{k} {v:.2f}" for k, v in r["plain_forward_ms_per_step"].items())
                        print(f"        untimed, inside the one-call forward: {inside}", flush=True)
    finally:
        kernels.attention_prefetch(2)
    kv = "" if args.kv_cache_dtype == "auto" else f"_kv{args.kv_cache_dtype}"
    out = Path(args.out or Path(__file__).parent / "results" / f"step_profile_{args.dtype}_{bundle.weights}{kv}.json")
    out.write_text(json.dumps({"dtype": args.dtype, "weights": bundle.weights, "kv_cache_dtype": args.kv_cache_dtype,
                               "steps": args.steps, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
