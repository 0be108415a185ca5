"""KV memory of one 8k-token Gemma 3 request with and without the sliding-window-aware cache.

    .venv/bin/python bench/window_cache.py [--tokens 8192] [--max-tokens 4] [--accounting-only]
                                           [--json bench/results/window_cache.json]

Engine mode (the default): the real Gemma 3 270M (bf16, CPU) runs one request of `--tokens` prompt
tokens and `--max-tokens` new ones, once with the window cache and once without (--no-window-cache);
after every step the blocks the request holds are read per KV cache group from the engine's cache
manager, and the peak, times each group's bytes a block, is the request's KV memory. The two runs'
tokens and logprobs are compared bit for bit (the seconds are the two runs' wall times on a shared
machine, not a claim). --accounting-only drives the same allocations (the
scheduler's chunks, the cache manager, the pool) on the real hyper-parameters without a forward.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

MiB = 1 << 20


def measure(bundle, hp, tokens: int, max_tokens: int, window_cache: bool, forward: bool) -> dict:
    import torch

    from isolab.config import CacheConfig, EngineConfig, SchedulerConfig
    from isolab.engine.kv_groups import kv_groups
    from isolab.engine.kv_storage import bytes_per_block, kv_cache_memory_for
    from isolab.engine.llm_engine import LLMEngine
    from isolab.sampling_params import SamplingParams

    bs, budget = 16, 512
    groups = kv_groups(hp, window_cache)
    per_block = bytes_per_block(hp, bs, torch.bfloat16, len(groups[0].layers))
    full_blocks = -(-(tokens + max_tokens) // bs) * len(groups)
    memory = kv_cache_memory_for(hp, bs, torch.bfloat16, full_blocks + 8, len(groups[0].layers))
    cfg = EngineConfig(model=str(bundle.path), dtype="bf16", cache=CacheConfig(bs, memory, False, window_cache),
                       scheduler=SchedulerConfig(1, budget))
    eng = LLMEngine(cfg, bundle)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, hp.vocab_size - 1000) for _ in range(tokens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    eng.add_request("r", prompt, params)
    peak = [0] * len(groups)
    decode = [0] * len(groups)
    out: list = []
    t0 = time.perf_counter()
    while eng.has_unfinished():
        if forward:
            for o in eng.step():
                out.extend((t, lp.logprob) for t, lp in zip(o.new_token_ids, o.new_logprobs, strict=True))
        else:  # the same chunks and allocations, no forward: the next token is a fixed one
            sched = eng.scheduler
            so = sched.schedule()
            from isolab.engine.step import ModelRunnerOutput, SampledToken

            sampled = tuple(SampledToken(ch.request.request_id, 1000, None) for ch in so.chunks if ch.samples)
            sched.update(so, ModelRunnerOutput(sampled, ()))
        held = eng.kv.num_held_blocks_by_group()
        if eng.requests.get("r") is not None or not forward:
            peak = [max(p, h) for p, h in zip(peak, held, strict=True)]
            req = eng.requests.get("r")
            if req is not None and req.num_computed_tokens > tokens:  # decode: the prompt done, a token since
                decode = [max(p, h) for p, h in zip(decode, held, strict=True)]
    seconds = time.perf_counter() - t0
    eng.close()
    return {
        "window_cache": window_cache,
        "groups": [{"layers": list(g.layers), "window": g.window} for g in groups],
        "bytes_per_block": per_block,
        "peak_blocks_by_group": peak,
        "decode_blocks_by_group": decode,
        "peak_bytes": sum(peak) * per_block,
        "decode_bytes": sum(decode) * per_block,
        "seconds": round(seconds, 1),
        "output": out,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--accounting-only", action="store_true")
    ap.add_argument("--json", default="bench/results/window_cache.json")
    args = ap.parse_args()
    import torch

    from isolab.models.bundle import load_bundle
    from isolab.models.invariance import cpu_description

    bundle = load_bundle(args.model, "bf16", "cpu")
    hp = bundle.hparams
    forward = not args.accounting_only
    runs = {name: measure(bundle, hp, args.tokens, args.max_tokens, wc, forward)
            for name, wc in (("with", True), ("without", False))}
    same = runs["with"].pop("output") == runs["without"].pop("output")
    result = {
        "model": args.model, "cpu": cpu_description(), "threads": torch.get_num_threads(), "dtype": "bf16", "block_size": 16, "max_num_batched_tokens": 512,
        "prompt_tokens": args.tokens, "max_tokens": args.max_tokens,
        "how": "engine: real forward, peak blocks held per KV group read after every step" if forward
        else "accounting: the scheduler's and cache manager's allocations on the real hparams, no forward",
        "outputs_bit_identical": same if forward else None,
        "runs": runs,
        "saving": round(1 - runs["with"]["peak_bytes"] / runs["without"]["peak_bytes"], 4),
    }
    for name, r in runs.items():
        print(f"{name:>7} window cache: peak {r['peak_bytes'] / MiB:7.2f} MiB (blocks per group {r['peak_blocks_by_group']}), "
              f"in decode {r['decode_bytes'] / MiB:7.2f} MiB, {r['seconds']} s")
    print(f"saving at peak: {result['saving']:.1%}; outputs bit-identical: {result['outputs_bit_identical']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
