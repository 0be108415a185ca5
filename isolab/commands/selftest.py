"""Owns `isolab selftest`: run the fault catalogue and print, per fault, which checks caught it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from isolab.commands.common import add_engine_args, engine_flags_set

if TYPE_CHECKING:
    from isolab.models.bundle import ModelBundle


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="inject each fault and show which checks catch it (healthy engine: none)",
                       description="Inject each fault and show which checks catch it. Of the engine flags, selftest "
                                   "takes --model, --dtype, --weights, --device, --gemm and --kv-cache-dtype (every "
                                   "scenario's engines on that pool); each fault scenario sets up the rest of its "
                                   "engines itself, so the others are refused.")
    p.add_argument("--tiny", action="store_true", help="use a tiny random model written to GGUF (seconds, not minutes)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--fault", action="append", default=[], help="only these faults (repeatable)")
    add_engine_args(p)
    for action in p._actions:  # the flags it refuses stay parsed (for the sentence), out of --help
        if action.dest in _NOT_TAKEN:
            action.help = argparse.SUPPRESS
    p.set_defaults(func=run)


# Engine flags selftest does not take: every scenario builds its own engines, with the pool, block
# size and limits its fault needs, and runs each one with and without the fault and with and without
# audit; --fault picks scenarios. Their dests: refused with a sentence when not the default.
_NOT_TAKEN = frozenset({"block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens",
                        "max_model_len", "no_prefix_cache", "no_window_cache", "audit", "inject_fault", "trace"})


def _refuse_untaken_flags(args: argparse.Namespace) -> None:
    from isolab.errors import InvalidRequestError

    for option, dest in engine_flags_set(args):
        if dest in _NOT_TAKEN:
            hint = "; use --fault to pick scenarios" if dest == "inject_fault" else ""
            raise InvalidRequestError(f"selftest does not take {option}: each fault scenario builds its own engines "
                                      f"(with and without the fault, with and without audit){hint}", field=dest)
    if args.tiny and args.model is not None:
        raise InvalidRequestError("give --tiny or --model, not both", field="model")


def run(args: argparse.Namespace) -> int:
    from isolab.commands.outputs import check_output_path, scratch_folders
    from isolab.faults import validate_faults
    from isolab.models.bundle import load_bundle

    _refuse_untaken_flags(args)
    validate_faults(frozenset(args.fault))
    check_output_path(args.json, "--json")  # before any work: a path that cannot be written is a sentence now
    with scratch_folders() as scratch:  # a --tiny model's folder goes when the command ends, however it ends
        if args.tiny:
            from isolab.testing.tiny_model import TinySpec, write_tiny_llama

            model = str(write_tiny_llama(scratch() + "/tiny.gguf", TinySpec(seed=1)))
        else:
            model = args.model
        return _run(args, load_bundle(model, args.dtype, args.device, gemm=args.gemm, weights=args.weights))


def _run(args: argparse.Namespace, bundle: ModelBundle) -> int:
    from rich.console import Console
    from rich.table import Table

    from isolab.engine.selftest import SCENARIOS, run_scenario
    from isolab.faults import FAULTS

    console = Console(stderr=False, width=None if sys.stdout.isatty() else 150)  # piped: the names whole
    numerics = bundle.engine_numerics(args.kv_cache_dtype)  # the engines' verdict (the int8 pool's attention too)
    console.print(f"numerics: {numerics.summary()}")
    pool = "" if args.kv_cache_dtype == "auto" else f", K/V pool {args.kv_cache_dtype}"
    table = Table(title=f"isolab selftest on {bundle.name} ({args.dtype}{pool})")
    for col in ("fault", "scenario", "healthy engine", "fault on", "fault on + audit", "divergence (C11)"):
        table.add_column(col)
    results = []
    ok = True
    for sc in SCENARIOS:
        if args.fault and sc.fault not in args.fault:
            continue
        kv = args.kv_cache_dtype  # every engine of the scenario (and its solo reference) on this pool
        healthy = run_scenario(bundle, sc, kv_cache_dtype=kv)
        healthy_audit = run_scenario(bundle, sc, audit=True, kv_cache_dtype=kv)
        faulty = run_scenario(bundle, sc, frozenset([sc.fault]), kv_cache_dtype=kv)
        faulty_audit = run_scenario(bundle, sc, frozenset([sc.fault]), audit=True, kv_cache_dtype=kv)
        passed = not healthy.caught and not healthy_audit.caught and faulty.caught and faulty_audit.caught
        ok &= passed
        div = ", ".join(f"{rid}: from token {f}, {w}/{t} wrong" for rid, f, w, t in faulty.divergence) or "-"
        table.add_row(
            sc.fault, sc.name,
            "clean" if not (healthy.caught or healthy_audit.caught) else "[red]" + ",".join(healthy.caught_by + healthy_audit.caught_by),
            ", ".join(faulty.caught_by) or "[red]not caught",
            ", ".join(faulty_audit.caught_by) or "[red]not caught",
            div,
        )
        results.append({
            "fault": sc.fault, "scenario": sc.name, "description": FAULTS[sc.fault], "workload": sc.what,
            "healthy_caught_by": healthy.caught_by + healthy_audit.caught_by,
            "fault_caught_by": faulty.caught_by, "fault_audit_caught_by": faulty_audit.caught_by,
            "fault_details": faulty.details, "fault_audit_details": faulty_audit.details,
            "divergence": [dict(request=r, first_wrong_token=f, wrong=w, after=t) for r, f, w, t in faulty.divergence],
            "passed": passed,
        })
    console.print(table)
    console.print("every fault caught, healthy engine clean" if ok else "[red]SELFTEST FAILED")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": bundle.name, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                       "numerics": numerics.to_json(), "results": results,
                       "passed": ok}, fh, indent=2)
    sys.stdout.flush()
    return 0 if ok else 1
