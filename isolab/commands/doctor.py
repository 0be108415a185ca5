"""Owns `isolab doctor`: the seed's four diagnosis questions (claim C12), run as experiments.

    isolab doctor --tiny --engine-args "--inject-fault coarse-key"
    isolab doctor --base-url http://localhost:8000 --no-cache-field cache_prompt=false

Exit status: 0 when no symptom was found, 1 when one was (the verdict says what kind), 2 on bad input,
3 when none was seen but the runs could not have shown a cache fault (the cache served no token, or
the server does not report cached_tokens): inconclusive, as `isolab probe` says it.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable

from isolab.errors import InvalidRequestError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="answer the four diagnosis questions by experiment; print a verdict")
    tgt = p.add_argument_group("target (an isolab engine in process by default)")
    tgt.add_argument("--engine-args", default="", metavar="ARGS",
                     help='engine flags as for `isolab generate`, in one string: "--inject-fault coarse-key --kv-cache-memory 128KiB"')
    tgt.add_argument("--tiny", action="store_true", help="use a tiny random model (seconds, not minutes)")
    tgt.add_argument("--base-url", default=None, metavar="URL", help="diagnose an OpenAI-compatible server instead")
    _add_server_args(tgt)
    w = p.add_argument_group("workload and checks")
    w.add_argument("--workload", default=None, metavar="FILE.jsonl",
                   help='one {"prompt", "max_tokens"?, "temperature"?, "seed"?, "scope"?} a line (default: the built-in mix)')
    w.add_argument("--check", action="append", default=[], metavar="SPEC",
                   help="python:module:function(prompt, text) -> ok, or a regex every output must match (repeatable)")
    w.add_argument("--concurrency", default="1,2,4,8,16", help="the load sweep (1,2,4,8,16)")
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="FILE", help="write the findings and the verdict as JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="plot the symptom rate against concurrency")
    p.set_defaults(func=run)


def _add_server_args(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """The flags that only a --base-url target reads."""
    g.add_argument("--model-name", default=None, help="the server's model name (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="the server's API key (sent as a Bearer token)")
    g.add_argument("--scope-field", default="cache_salt", help="the body field that carries an item's scope (server)")
    g.add_argument("--no-cache-field", default=None, metavar="FIELD=VALUE",
                   help="the per-request switch that turns the server's prompt cache off, e.g. cache_prompt=false")
    g.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="server only: seconds to wait for each completion (120)")
    g.add_argument("--tie-margin", type=float, default=0.1,
                   help="server only: a first difference within this many nats is a near-tie (0.1)")


def _engine_kwargs(text: str, tiny: bool, tiny_dir: Callable[[], str]) -> dict:
    """The engine flags in --engine-args, checked as the engine would check them (before any model is
    written or loaded); with --tiny and no --model, a tiny model written under tiny_dir()."""
    from isolab.commands.common import add_engine_args, llm_kwargs
    from isolab.commands.outputs import check_output_path
    from isolab.config import build_engine_config

    parser = argparse.ArgumentParser(prog="--engine-args", add_help=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        ns, rest = parser.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, argparse.ArgumentTypeError, ValueError) as exc:
        raise InvalidRequestError(f"--engine-args: {exc}", field="engine_args") from None
    if rest:
        raise InvalidRequestError(f"--engine-args: unknown engine flags {' '.join(rest)}", field="engine_args")
    try:
        build_engine_config(**llm_kwargs(ns))  # block size, cache bytes, limits, faults: the engine's own checks
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"--engine-args: {exc}", field="engine_args") from None
    check_output_path(ns.trace, "--trace")
    if tiny and ns.model is not None:
        raise InvalidRequestError("give --tiny or --model in --engine-args, not both", field="engine_args")
    if tiny:
        import torch

        from isolab.testing.tiny_model import TinySpec, write_tiny_llama

        torch.set_num_threads(1)  # a model this small is faster on one thread than on shared cores
        ns.model = str(write_tiny_llama(tiny_dir() + "/tiny.gguf", TinySpec(layers=2, seed=1)))
        ns.device = ns.device or "cpu"
    return llm_kwargs(ns)


def run(args: argparse.Namespace) -> int:
    import sys

    from isolab.commands.outputs import check_output_path, scratch_folders
    from isolab.doctor.experiments import EngineTarget, Target, diagnose
    from isolab.doctor.report import plot_sweep, print_report, write_json
    from isolab.doctor.symptoms import parse_check
    from isolab.doctor.verdict import NO_SYMPTOM, UNEXERCISED, judge
    from isolab.doctor.workload import builtin_workload, load_jsonl

    check_output_path(args.json, "--json")  # before any work: a path that cannot be written is a sentence now
    check_output_path(args.plot, "--plot", plot=True)
    try:
        concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
        assert concurrencies and min(concurrencies) >= 1
    except (ValueError, AssertionError):
        raise InvalidRequestError(f"--concurrency {args.concurrency!r}: write positive integers like 1,2,4,8,16", field="concurrency") from None
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise InvalidRequestError(f"--timeout must be a positive number of seconds, not {args.timeout}", field="timeout")
    if not (math.isfinite(args.tie_margin) and args.tie_margin >= 0):
        raise InvalidRequestError(f"--tie-margin must be 0 or more nats, not {args.tie_margin}", field="tie_margin")
    from isolab.commands.common import flags_set

    found = flags_set(args, _add_server_args) if not args.base_url else []
    if found:  # (they were ignored without a word)
        raise InvalidRequestError(f"{found[0][0]} is for a server: it needs --base-url (without it the engine runs "
                                  "in this process)", field="base_url")
    checks = [parse_check(c) for c in args.check]
    items = load_jsonl(args.workload) if args.workload else builtin_workload()
    with scratch_folders() as tiny_dir:  # a --tiny model's folder goes when the command ends, however it ends
        target: Target
        if args.base_url:
            from isolab.doctor.http_target import HttpTarget, parse_field

            if args.engine_args:
                raise InvalidRequestError("give --engine-args or --base-url, not both", field="base_url")
            if args.tiny:
                raise InvalidRequestError("give --tiny or --base-url, not both", field="base_url")
            target = HttpTarget(args.base_url, model=args.model_name, api_key=args.api_key,
                                scope_field=args.scope_field or None,
                                no_cache=parse_field(args.no_cache_field) if args.no_cache_field else None,
                                timeout_s=args.timeout)
        else:
            target = EngineTarget(_engine_kwargs(args.engine_args, args.tiny, tiny_dir))
        findings = diagnose(target, items, concurrencies=concurrencies, checks=checks, tie_margin=args.tie_margin,
                            log=lambda s: print(f"  running {s}", file=sys.stderr))
    verdict = judge(findings)
    print_report(findings, verdict)
    if args.json:
        write_json(findings, verdict, args.json, {"engine_args": args.engine_args, "base_url": args.base_url})
    if args.plot:
        plot_sweep(findings, args.plot)
    return {NO_SYMPTOM: 0, UNEXERCISED: 3}.get(verdict.verdict, 1)
