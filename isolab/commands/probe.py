"""Owns `isolab probe`: black-box isolation checks of any OpenAI-compatible server.

Exit codes: 0 every scenario passed (an opt-in check may be inconclusive), 1 a scenario failed,
2 bad usage or an unreachable server (one sentence on stderr), 3 nothing failed but a scenario
could not decide (e.g. the server reports no cached_tokens or no logprobs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from isolab.probe.scenarios import SCENARIOS

    p = sub.add_parser("probe", help="black-box isolation checks of an OpenAI-compatible server",
                       description="Probe a server from outside: concurrency invariance, prefix-cache correctness, "
                                   "reuse staleness, tenant isolation, seeded sampling, content in monitoring.")
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="repeatable; two keys make the tenant test use two tenants, otherwise two cache_salt values")
    p.add_argument("--model", default=None, help="the model id to send (default: the first in /v1/models)")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.json, report.md and plots here")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the table")
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), metavar="NAME",
                   help=f"run only these (repeatable): {', '.join(SCENARIOS)}")
    p.add_argument("--timing", nargs="?", type=int, const=250, default=0, metavar="N",
                   help="opt-in: KS test on TTFT across tenants with N samples per group (default N: 250)")
    p.add_argument("--margin", type=float, default=0.5, help="nats: a divergence where the reference was surer than "
                   "this is contamination, below it batch variance (0.5)")
    p.add_argument("--exact", action="store_true", help="any difference is contamination (for batch-invariant servers)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy output length per request (16)")
    p.add_argument("--flood", type=int, default=12, help="concurrent background requests (12)")
    p.add_argument("--first-blocks", type=int, default=64, help="novel prompts in the colliding-keys check (64)")
    p.add_argument("--seed", type=int, default=None, help="the probe's own randomness (prompts, canaries)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (120)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from isolab.probe import ProbeConfig, ProbeUsageError, Sizes, Thresholds, run_probe_sync
    from isolab.probe.report import print_summary, to_json, write_report
    from isolab.probe.runner import EXIT_USAGE, estimate_requests
    from isolab.probe.scenarios import SCENARIOS

    if args.report:
        _check_report_folder(args.report)  # before any request: an unwritable --report is a sentence now
    try:
        cfg = ProbeConfig(
            base_url=args.base_url, api_keys=tuple(args.api_key), model=args.model,
            scenarios=tuple(args.scenario or SCENARIOS),
            sizes=Sizes(args.max_tokens, args.flood, args.first_blocks, args.timing),
            thresholds=Thresholds(margin=args.margin, exact=args.exact), seed=args.seed, timeout_s=args.timeout,
        )
    except (ProbeUsageError, ValueError) as exc:
        print(f"isolab: error: {exc}", file=sys.stderr)  # (as every command)
        return EXIT_USAGE
    bar = tqdm(total=estimate_requests(cfg, len(cfg.api_keys) >= 2), unit="req", disable=args.no_progress or None,
               file=sys.stderr, dynamic_ncols=True)
    try:
        result = run_probe_sync(cfg, on_request=lambda: bar.update(1), on_scenario=bar.set_description)
    except ProbeUsageError as exc:
        bar.close()
        print(f"isolab: error: {exc}", file=sys.stderr)  # (as every command)
        return EXIT_USAGE
    bar.close()
    if args.json:
        print(json.dumps(to_json(result), indent=1))
    else:
        print_summary(result)
    if args.report:
        out = write_report(result, Path(args.report))
        print(f"report: {out / 'report.md'}", file=sys.stderr)
    return result.exit_code


def _check_report_folder(path: str) -> None:
    """--report names a folder that exists or can be made (with its missing parents, as write_report does)."""
    from isolab.commands.outputs import check_output_path

    check_output_path(path, "--report", folder=True, make_parents=True)
