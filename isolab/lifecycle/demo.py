"""Owns the lifecycle demo: a small mixed workload (prefix sharing, a small pool that recycles) run
with the trace on, healthy or under a fault, and drawn.

    python -m isolab.lifecycle.demo --out docs/img/lifecycle_mixed.png
    python -m isolab.lifecycle.demo --fault reuse-without-invalidate --audit --out docs/img/lifecycle_reuse_fault_audit.png

    step  0  A  = P + 2 tokens   (P: 40 tokens, two full blocks)     decodes 8
    step  3  B  = P + 1 token    hits A's two sealed blocks           decodes 6
    step  4  C  = 30 other tokens                                    decodes 10
    step  9  E  = 50 other tokens: the pool is short, P's idle blocks are evicted for E
    step 12  D  = P + 3 tokens   asks for P again: a miss when healthy; under
                                 reuse-without-invalidate it is handed E's blocks
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from isolab.sampling_params import SamplingParams
from isolab.testing.workload import Arrival, drive, make_engine

KV_BLOCKS = 8


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def arrivals(seed: int = 3) -> list[Arrival]:
    rng = random.Random(seed)
    p = tuple(rng.randrange(100, 250) for _ in range(40))
    return [
        Arrival(0, "A", p + (101, 102), _greedy(8)),
        Arrival(3, "B", p + (103,), _greedy(6)),
        Arrival(4, "C", tuple(rng.randrange(100, 250) for _ in range(30)), _greedy(10)),
        Arrival(9, "E", tuple(rng.randrange(100, 250) for _ in range(50)), _greedy(6)),
        Arrival(12, "D", p + (104, 105, 106), _greedy(5)),
    ]


def run_traced(bundle, trace_path: str | Path, *, faults: frozenset[str] = frozenset(), audit: bool = False,  # noqa: ANN001
               kv_blocks: int = KV_BLOCKS) -> list[str]:
    """Run the demo workload with the trace written to `trace_path`; returns the engine's problems
    (the errors, audit violations among them, that ended a request)."""
    eng = make_engine(bundle, kv_blocks, audit=audit, faults=faults, trace_path=str(trace_path))
    run = drive(eng, arrivals())
    eng.close()
    return [f"audit: {err}" for _, err in run.errors()]


def main(argv: list[str] | None = None) -> int:
    from isolab.lifecycle.draw import write_html, write_png
    from isolab.lifecycle.trace import load, summary_lines
    from isolab.models.bundle import load_bundle

    ap = argparse.ArgumentParser(prog="python -m isolab.lifecycle.demo")
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", default=None, help="keep the trace here")
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("--audit", action="store_true")
    ap.add_argument("--model", default=None, help="default: the tiny random model")
    args = ap.parse_args(argv)
    from isolab.commands.outputs import check_output_path, scratch_folders

    check_output_path(args.out, "--out", plot=not args.out.endswith(".html"))  # before the run, not after it
    check_output_path(args.trace, "--trace")
    with scratch_folders() as scratch:  # the tiny model and an unkept trace go when the demo ends
        if args.model is None:
            from isolab.testing.tiny_model import TinySpec, write_tiny_llama

            args.model = str(write_tiny_llama(scratch() + "/tiny.gguf", TinySpec(layers=2, seed=1)))
        bundle = load_bundle(args.model, "bf16", "cpu")
        trace_path = args.trace or scratch() + "/trace.jsonl"
        problems = run_traced(bundle, trace_path, faults=frozenset(args.fault), audit=args.audit)
        trace = load(trace_path)
    what = f"fault {', '.join(args.fault)}" if args.fault else "healthy engine"
    title = (f"KV block lifecycle, {what}{' (audit mode)' if args.audit else ''}\n"
             f"mixed workload: a shared 40-token prefix, a {KV_BLOCKS}-block pool that recycles")
    (write_html if args.out.endswith(".html") else write_png)(trace, args.out, title)
    print("\n".join(summary_lines(trace)))  # (as `isolab lifecycle` prints it: it printed a dict)
    for p in problems:
        print(" ", p[:200])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from isolab.cli import guarded

    raise SystemExit(guarded(main))
