"""Issue 14's ceiling: the most tok/s a decode step of C rows can give on this machine, and so the
most that 128 concurrent requests can gain over 32 on a workload.

A decode step of C rows must read every weight once and every row's keys and values, and must run
its GEMMs at M = C. For each concurrency C, on the workload `isolab bench --concurrency C
--num-requests 2C` runs (its prompts tokenized as that bench does; a row's mean context over its
decode steps is its prompt plus half its new tokens):

    memory floor  = (weight bytes + C x K/V bytes of a row at its mean context) / read bandwidth
    compute floor = the step's GEMMs at M = C, each weight hot in cache (the engine's own kernels)
    step floor    = max(memory floor, compute floor): perfect overlap, so an optimistic floor
    ceiling       = C / step floor (tok/s), and ceiling(C2) / ceiling(C1) the most C2 can gain

The memory ceiling alone (C / memory floor) holds for any engine that reads these weights and a
16-bit K/V cache once a step; the compute floor is isolab's kernels'. A second ceiling adds the
prompts: each prompt token at the GEMMs' hot rate for a chunk of 512 rows (a cost a request pays
at every C, so it lowers the ratio too). Left out, each of which only
lowers a ceiling: attention's arithmetic, the row ops, sampling and the scheduler. The read
bandwidth is measured here: torch sums a 1 GiB tensor on the engine's threads (best of 5). A
what-if line gives the ratio with an 8-bit K/V cache (half the bytes; isolab has none).

    .venv/bin/python bench/roofline.py [--model gemma3-270m] [--concurrency 32,128]
        [--prompt-len 64:256] [--output-len 128] [--weights native,dense] [--json FILE]

Writes bench/results/roofline_MODEL.json by default. Run it alone (2 cores).
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
from isolab.bench.workload import WorkloadSpec, make_workload  # noqa: E402
from isolab.models.bundle import ModelBundle, load_bundle  # noqa: E402
from isolab.models.linear import QuantWeight, StackedWeight  # noqa: E402

PREFILL_CHUNK = 512  # rows of a prompt step: the engine's default max_num_batched_tokens


def read_bandwidth(gib: float = 1.0, rounds: int = 5) -> float:
    """Bytes a second that torch.sum reads from a tensor far larger than the caches (best of rounds)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def in_features(w) -> int:
    if isinstance(w, StackedWeight):
        return in_features(w.parts[0])
    if isinstance(w, QuantWeight):
        assert w.packed is not None, "the roofline times the native kernels (isolab's own build)"
        return w.packed.shape[1] * 32
    if w.path == "isolab":  # packed panels: bf16 (N/16, K/2, 16, 2), fp32 (N/16, K, 16)
        return int(w.data.shape[1] * (2 if w.data.dim() == 4 else 1))
    return int(w.data.shape[1])  # (N, K)


def gemm_ms(bundle: ModelBundle, m: int, reps: int = 3) -> float:
    """The step's GEMMs at M = m rows, each weight hot in cache: the sum of each GEMM's best of reps."""
    total = 0.0
    dtype = bundle.model.dtype
    for w in bundle.model.linears():
        x = torch.randn(m, in_features(w)).to(dtype)
        w(x)  # warm: its weight into cache
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            w(x)
            best = min(best, time.perf_counter() - t)
        total += best
    return total * 1e3


def kv_bytes_per_token(bundle: ModelBundle, context: float) -> float:
    """K and V bytes a row reads in one decode step at this context, over all layers (local layers
    read at most their window)."""
    hp = bundle.hparams
    per_layer_token = 2 * hp.num_kv_heads * hp.head_dim * bundle.model.dtype.itemsize
    local = hp.gemma and hp.sliding_window
    keys = sum(min(context, hp.sliding_window) if local and hp.is_local(i) else context
               for i in range(hp.num_layers))
    return keys * per_layer_token


def mean_tokens(bundle: ModelBundle, spec: WorkloadSpec) -> tuple[float, float]:
    """(mean prompt tokens, mean new tokens) of the workload's requests."""
    wl = make_workload(spec)
    prompts = [len(bundle.tokenizer.encode(p)) for p in wl.prompts]
    return statistics.mean(prompts), statistics.mean(wl.max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="32,128")
    ap.add_argument("--prompt-len", default="64:256", help="prompt words, LO:HI (issue 14's workload)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--weights", default="native,dense")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        concs = [int(c) for c in args.concurrency.split(",")]
        lo, _, hi = args.prompt_len.partition(":")
        prompt_len = (int(lo), int(hi or lo))
    except ValueError:
        print(f"roofline: --concurrency takes N,N,... and --prompt-len LO:HI, not {args.concurrency!r} / "
              f"{args.prompt_len!r}", file=sys.stderr)
        return 2
    bw = read_bandwidth()
    print(f"read bandwidth (torch.sum of 1 GiB, {torch.get_num_threads()} threads, best of 5): "
          f"{bw / 1e9:.1f} GB/s")
    result: dict = {"read_bandwidth_gb_s": bw / 1e9, "threads": torch.get_num_threads(),
                    "workload": {"prompt_words": list(prompt_len), "new_tokens": args.output_len,
                                 "num_requests": "2 x concurrency", "seed": 0}, "weights": {}}
    for weights in args.weights.split(","):
        bundle = load_bundle(args.model, weights=weights)
        result["model"] = bundle.path.name
        wb = sum(w.nbytes for w in bundle.model.linears())  # bytes a step reads of the weights
        rows = {}
        print(f"\n{bundle.path.name}, {weights} weights: {wb / 2**20:.1f} MiB of weights read a step")
        prefill_ms_per_token = gemm_ms(bundle, PREFILL_CHUNK, reps=1) / PREFILL_CHUNK
        print(f"a prompt token's GEMMs at M = {PREFILL_CHUNK} (hot): {prefill_ms_per_token * 1e3:.1f} us")
        print(f"{'C':>5} {'context':>8} {'K/V MiB':>8} {'memory ms':>10} {'GEMM ms':>8} {'floor ms':>9} "
              f"{'ceiling tok/s':>14} {'with prompts':>14}")
        for c in concs:
            prompt, new = mean_tokens(bundle, WorkloadSpec(num_requests=2 * c, prompt_len=prompt_len,
                                                           output_len=(args.output_len, args.output_len)))
            ctx = prompt + (new + 1) / 2  # the keys a decode step reads, averaged over a request's steps
            kv = c * kv_bytes_per_token(bundle, ctx)
            mem = (wb + kv) / bw * 1e3
            mem8 = (wb + kv / 2) / bw * 1e3
            g = gemm_ms(bundle, c)
            floor = max(mem, g)
            # with its prompt: a request's prompt tokens at the GEMMs' hot rate for a full chunk, then
            # its new tokens at the step floor's per-row share
            with_prefill = new / (prompt * prefill_ms_per_token + new * floor / c) * 1e3
            rows[c] = {"mean_prompt_tokens": prompt, "mean_context": ctx, "kv_mib": kv / 2**20,
                       "memory_floor_ms": mem, "gemm_hot_ms": g, "step_floor_ms": floor,
                       "ceiling_tok_s": c / floor * 1e3, "ceiling_tok_s_memory": c / mem * 1e3,
                       "ceiling_tok_s_kv8": c / max(mem8, g) * 1e3,
                       "ceiling_tok_s_with_prefill": with_prefill,
                       "bound_by": "memory" if mem >= g else "GEMMs"}
            print(f"{c:>5} {ctx:>8.1f} {kv / 2**20:>8.1f} {mem:>10.2f} {g:>8.2f} {floor:>9.2f} "
                  f"{rows[c]['ceiling_tok_s']:>14.1f} {with_prefill:>14.1f}")
        ratios = {f"{b}/{a}": {k: rows[b][f"ceiling_tok_s{x}"] / rows[a][f"ceiling_tok_s{x}"]
                               for k, x in (("ceiling_ratio", ""), ("ceiling_ratio_kv8", "_kv8"),
                                            ("ceiling_ratio_with_prefill", "_with_prefill"),
                                            ("memory_ceiling_ratio", "_memory"))}
                  for a, b in zip(concs, concs[1:], strict=False)}
        for k, r in ratios.items():
            print(f"ceiling {k}: {r['ceiling_ratio']:.2f}x; with the prompts: "
                  f"{r['ceiling_ratio_with_prefill']:.2f}x; with an 8-bit K/V cache: "
                  f"{r['ceiling_ratio_kv8']:.2f}x; "
                  f"memory alone (any engine): {r['memory_ceiling_ratio']:.2f}x")
        result["weights"][weights] = {"weight_mib": wb / 2**20, "rows": rows, "ratios": ratios,
                                      "prefill_gemm_us_per_token": prefill_ms_per_token * 1e3}
        del bundle
    out = Path(args.json or f"bench/results/roofline_{Path(result['model']).stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
