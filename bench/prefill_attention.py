"""A prompt chunk's attention with its rows four at a time, against every row alone, in one run.

The paged-attention kernel on AVX512-BF16 (no AMX) runs a prompt chunk's rows in units of four
consecutive positions of one table, one pass over their keys for the four (attend_rows_bf16);
`kernels.attention_row_units(False)` runs every row alone, as before. The two alternate:
  kernel:  the kernel alone on a chunk of T rows (positions 0..T-1 of one table, SmolLM2-135M's
           shape: 9 query heads on 3 KV heads of 64 dims, bf16), a layer a call; outputs compared
           bit for bit;
  engine:  a T-token prompt's prefill through LLMEngine on the real model (bf16, native weights),
           with forward.cpp's own clock on attention; each prompt new (no prefix-cache hit).

    .venv/bin/python bench/prefill_attention.py [--tokens 128,512] [--rounds 5]

Writes bench/results/prefill_attention.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab import kernels  # noqa: E402
from isolab.models.invariance import cpu_description  # noqa: E402

MiB = 1 << 20
HKV, G, DH, BS, LAYERS = 3, 3, 64, 16, 30


def kernel_case(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    nb = (tokens + BS - 1) // BS
    kv = torch.randn(2, HKV, nb + 1, BS, DH, generator=g).to(torch.bfloat16)
    tables = torch.arange(1, nb + 1, dtype=torch.int32).view(1, nb)
    q = torch.randn(tokens, HKV * G, DH, generator=g).to(torch.bfloat16)
    rows = torch.zeros(tokens, dtype=torch.int32)
    pos = torch.arange(tokens, dtype=torch.int32)
    return lambda: kernels.paged_attention(q, kv, tables, rows, pos, DH**-0.5)


def time_calls(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_attention.json"))
    args = ap.parse_args()
    if not kernels.attention_row_units(True) or kernels.attention_isa() != "avx512bf16":
        print("the row units are in the AVX512-BF16 attention kernel, which this CPU does not run "
              f"(it runs {kernels.attention_isa() if kernels.native_ready() else 'no native kernels'})")
        return 2
    from isolab.config import build_engine_config
    from isolab.engine.llm_engine import LLMEngine
    from isolab.models.bundle import load_bundle
    from isolab.sampling_params import SamplingParams

    bundle = load_bundle(None, "bf16", weights="native")
    rows = []
    try:
        for tokens in (int(t) for t in args.tokens.split(",")):
            fn = kernel_case(tokens)
            kernels.attention_row_units(False)
            alone = fn()
            kernels.attention_row_units(True)
            assert torch.equal(fn(), alone), "row units changed a bit"
            kern: dict[bool, list[float]] = {False: [], True: []}
            eng_ms: dict[bool, list[float]] = {False: [], True: []}
            attn_ms: dict[bool, list[float]] = {False: [], True: []}
            engine = LLMEngine(build_engine_config(dtype="bf16", weights="native", max_num_seqs=4,
                                                   kv_cache_memory=512 * MiB,
                                                   max_num_batched_tokens=max(2048, tokens)), bundle)
            try:
                for rnd in range(args.rounds):
                    for on in ((False, True) if rnd % 2 == 0 else (True, False)):
                        kernels.attention_row_units(on)
                        fn()
                        kern[on].append(time_calls(fn, 5) * LAYERS)
                        ids = [(rnd * 7 + int(on) * 3 + i * 7919) % 40000 + 100 for i in range(tokens)]
                        engine.add_request(f"p{rnd}{int(on)}", ids, SamplingParams(max_tokens=1, temperature=0,
                                                                                      ignore_eos=True))
                        kernels.forward_profile(True)
                        t = time.perf_counter()
                        while engine.has_unfinished():
                            engine.step()
                        eng_ms[on].append((time.perf_counter() - t) * 1e3)
                        attn_ms[on].append((kernels.forward_profile(False) or {}).get("attention", 0.0))
            finally:
                kernels.attention_row_units(True)
                engine.close()
            med = {k: {str(on).lower(): statistics.median(v[on]) for on in (False, True)}
                   for k, v in (("kernel_30_layers_ms", kern), ("engine_prefill_ms", eng_ms),
                                ("engine_attention_ms", attn_ms))}
            row = {"tokens": tokens, "medians": med,
                   "prefill_tok_per_s": {k: tokens / (v / 1e3) for k, v in med["engine_prefill_ms"].items()},
                   "runs": {"kernel_30_layers_ms": kern, "engine_prefill_ms": eng_ms, "engine_attention_ms": attn_ms}}
            row["runs"] = {k: {str(on).lower(): v[on] for on in (False, True)} for k, v in row["runs"].items()}
            rows.append(row)
            print(f"T={tokens:5d}  kernel, 30 layers: {med['kernel_30_layers_ms']['false']:.1f} -> "
                  f"{med['kernel_30_layers_ms']['true']:.1f} ms   engine prefill: {med['engine_prefill_ms']['false']:.1f} "
                  f"-> {med['engine_prefill_ms']['true']:.1f} ms ({row['prefill_tok_per_s']['false']:.0f} -> "
                  f"{row['prefill_tok_per_s']['true']:.0f} tok/s), its attention {med['engine_attention_ms']['false']:.1f} "
                  f"-> {med['engine_attention_ms']['true']:.1f} ms  (rows alone -> four at a time; medians of "
                  f"{args.rounds})", flush=True)
    finally:
        kernels.attention_row_units(True)
    out = Path(args.out)
    out.write_text(json.dumps({"cpu": cpu_description(), "attention_isa": kernels.attention_isa(),
                               "rounds": args.rounds, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
