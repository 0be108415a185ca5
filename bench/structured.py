"""Structured outputs on the real model (issue 15): 50 varied JSON schemas at 32 concurrent, every
output parsed and validated, the grammar mask's cost per token, and throughput against the same
requests unconstrained (same prompts, each run to the constrained output's length).

    .venv/bin/python bench/structured.py [--dtype bf16] [--concurrency 32]

Writes bench/results/structured_DTYPE.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab.config import build_engine_config  # noqa: E402
from isolab.engine import sampler, scheduler  # noqa: E402
from isolab.engine.llm_engine import LLMEngine  # noqa: E402
from isolab.models.bundle import load_bundle  # noqa: E402
from isolab.sampling_params import GrammarSpec, SamplingParams  # noqa: E402
from isolab.testing.schemas import schema_corpus  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], concurrency: int) -> dict:
    pending = list(range(len(prompts)))
    live, outs = 0, {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and live < concurrency:
            i = pending.pop(0)
            engine.add_request(f"q{i}", prompts[i], params[i])
            live += 1
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id[1:])] = o
                live -= 1
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_token_ids) for o in outs.values())
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "outputs": outs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bundle = load_bundle(None, args.dtype)
    engine = LLMEngine(build_engine_config(dtype=args.dtype), bundle)
    schemas = schema_corpus(50, seed=1)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Reply with a JSON object that matches this "
                                         f"schema: {json.dumps(s)}"}]) for s in schemas]
    constrained = [SamplingParams(max_tokens=400, temperature=0.7, seed=i, structured=GrammarSpec.json_schema(s))
                   for i, s in enumerate(schemas)]
    spent = {"mask": 0.0, "update": 0.0, "fill": 0.0}
    real_mask, real_update = sampler._grammar_mask, scheduler.Scheduler.update
    import llguidance.torch as llt

    real_fill = llt.fill_next_token_bitmask

    def timed(key: str, fn):  # fn, with its seconds added to spent[key]
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return run

    # (a plain function set on the class is bound: Scheduler.update's self arrives in *a)
    timed_fill, timed_mask, timed_update = timed("fill", real_fill), timed("mask", real_mask), timed("update", real_update)

    engine.grammars  # noqa: B018 - build the tokenizer's grammar tables outside the timing
    t = time.perf_counter()
    for s in constrained:
        engine.grammars.compile(s.structured)  # type: ignore[arg-type]
    compile_s = time.perf_counter() - t
    sampler._grammar_mask, scheduler.Scheduler.update, llt.fill_next_token_bitmask = timed_mask, timed_update, timed_fill
    try:
        con = run(engine, prompts, constrained, args.concurrency)
    finally:
        sampler._grammar_mask, scheduler.Scheduler.update, llt.fill_next_token_bitmask = real_mask, real_update, real_fill
    valid = 0
    for i, s in enumerate(schemas):
        try:
            jsonschema.validate(json.loads(tok.decode(con["outputs"][i].output_token_ids)), s)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    lengths = [len(con["outputs"][i].output_token_ids) for i in range(len(schemas))]
    free = [SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    engine.close()  # a fresh engine: the unconstrained run must not find the prompts in the prefix cache
    unc = run(LLMEngine(build_engine_config(dtype=args.dtype), bundle), prompts, free, args.concurrency)
    res = {
        "dtype": args.dtype, "concurrency": args.concurrency, "schemas": len(schemas),
        "valid": valid, "finished_stop": sum(con["outputs"][i].finish_reason == "stop" for i in range(len(schemas))),
        "compile_s_all_schemas": compile_s,
        "constrained_tok_per_s": con["output_tokens_per_s"], "unconstrained_tok_per_s": unc["output_tokens_per_s"],
        "ratio": con["output_tokens_per_s"] / unc["output_tokens_per_s"],
        "mask_ms_per_token": spent["mask"] * 1e3 / con["output_tokens"],
        "of_which_llguidance_fill_ms_per_token": spent["fill"] * 1e3 / con["output_tokens"],
        "update_ms_per_token_with_matcher": spent["update"] * 1e3 / con["output_tokens"],
        "output_tokens": con["output_tokens"], "mean_output_tokens": con["output_tokens"] / len(schemas),
    }
    print(json.dumps(res, indent=2))
    out = Path(args.out or Path(__file__).parent / "results" / f"structured_{args.dtype}.json")
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
