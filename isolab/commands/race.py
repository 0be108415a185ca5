"""Owns the race lab's command line: `isolab race stress|explore|bench` and `isolab passcode serve`.

Each leaf parser sets `func(args) -> int`; bad input raises InvalidRequestError (exit 2).
`explore` exits like a test runner (explorer.types.ExitCode): 0 the target holds within the
bound, 1 a losing schedule was found or replayed, 2 usage or target error (one sentence),
3 inconclusive (a budget ran out, or the model cannot run the target; the reason is printed).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from isolab.errors import InvalidRequestError

REPLAY_TIMES = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    race = subparsers.add_parser("race", help="the race lab: stress the passcode checkers, explore interleavings")
    sub = race.add_subparsers(dest="race_command", metavar="SUBCOMMAND")
    race.set_defaults(func=lambda args: (race.print_help(), 2)[1])

    stress = sub.add_parser("stress", help="hammer a shared checker with real threads and count false accepts")
    stress.add_argument("--variant", default="buggy", help="variant name, comma list, or 'all' (default: buggy)")
    stress.add_argument("--threads", default="2,4,8,16,32", help="comma list of thread counts (default: 2,4,8,16,32)")
    stress.add_argument("--requests", type=int, default=100_000,
                        help="check() calls per run, over all threads (default: 100000)")
    stress.add_argument("--repeat", type=int, default=3, help="runs per (variant, threads) (default: 3)")
    stress.add_argument("--right-share", type=float, default=0.5, help="share of threads sending the right passcode")
    stress.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the runs (s)")
    stress.add_argument("--json", type=Path, default=None, help="write every run to this JSON file")
    stress.add_argument("--plot", type=Path, default=None, help="write false-accept rate vs threads to this PNG")
    stress.set_defaults(func=_stress)

    explore = sub.add_parser("explore", help="explore thread interleavings of a scenario deterministically",
                             description="Explore a scenario's thread interleavings deterministically, or replay a "
                                         "saved schedule. Exit status: 0 HOLDS, 1 FAILED (a losing schedule), 2 a "
                                         "usage or target error, 3 INCONCLUSIVE (a budget ran out, or the model "
                                         "cannot run the target). docs/race.md")
    explore.add_argument("target", nargs="?",
                         help="passcode:VARIANT, fixtures:NAME, workloads:NAME (--list), module:name or file.py:name")
    _add_search_args(explore)
    explore.add_argument("--replay", type=Path, default=None, help="replay a saved schedule instead of searching")
    explore.add_argument("--times", type=int, default=REPLAY_TIMES, help=f"replays of --replay (default {REPLAY_TIMES})")
    explore.add_argument("--list", action="store_true", help="list the built-in scenarios")
    explore.add_argument("--trace-module", action="append", default=[], metavar="MODULE",
                         help="also trace this module (repeatable); by default the target's folder and the "
                              "non-stdlib, non-site-packages modules it imports are traced")
    explore.add_argument("--max-steps", type=int, default=10_000,
                         help="choice points per execution before a thread counts as making no progress (10000)")
    explore.add_argument("--max-bytecodes", type=int, default=2_000_000,
                         help="traced bytecodes per execution before a thread counts as making no progress "
                              "(2000000)")
    explore.add_argument("--stall-seconds", type=float, default=3.0,
                         help="a running thread that executes no traced code this long is blocked outside the model "
                              "(3 s)")
    explore.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    explore.set_defaults(func=_explore)

    bench = sub.add_parser("bench", help="QPS per variant at 8 threads side by side, and explorer executions/s")
    bench.add_argument("--requests", type=int, default=100_000,
                       help="check() calls per QPS run (default: 100000); the service part sends 8 %% of them")
    bench.add_argument("--repeat", type=int, default=3, help="QPS runs per variant (default: 3)")
    bench.add_argument("--threads", type=int, default=8,
                       help="threads of every QPS run and the service part's clients (default: 8)")
    bench.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    bench.set_defaults(func=_bench)

    passcode = subparsers.add_parser("passcode", help="the seed's passcode service over HTTP")
    psub = passcode.add_subparsers(dest="passcode_command", metavar="SUBCOMMAND")
    passcode.set_defaults(func=lambda args: (passcode.print_help(), 2)[1])
    serve = psub.add_parser("serve", help="serve POST /check with a chosen checker variant (passcode from $ISOLAB_PASSCODE)",
                            description="Serve POST /check {\"passcode\": ...} -> {\"accepted\": bool} with a checker "
                                        "variant. The passcode comes from $ISOLAB_PASSCODE (kept only as a salted "
                                        "scrypt digest, never logged). Replies: 200, 400 (a bad body), 404/405, "
                                        "411/413 (no or too large a body), 429 (over --max-attempts per --window, "
                                        "with Retry-After). docs/race.md")
    serve.add_argument("--variant", default="lock_local", help="the checker variant (default: lock_local)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="port to listen on (default: 8765)")
    serve.add_argument("--max-attempts", type=int, default=10,
                       help="attempts per client per window; 0 = no limit (default: 10)")
    serve.add_argument("--window", type=float, default=60.0,
                       help="rate-limit window in seconds, at most a day (default: 60)")
    serve.add_argument("--scrypt-n", type=int, default=2**14, help="scrypt cost (a power of two)")
    serve.add_argument("--quiet", action="store_true",
                       help="no line a request on stderr (its client, route, status and verdict): warnings only")
    serve.set_defaults(func=_serve)


def _add_search_args(explore: argparse.ArgumentParser) -> None:
    """The flags of a search, which a --replay (its schedule fixes the switch mode and every step) refuses."""
    explore.add_argument("--switch", choices=("gil", "line", "opcode"), default="opcode",
                         help="where a thread may be switched out (default: opcode, the free-threaded stand-in)")
    explore.add_argument("--strategy", choices=("bounded", "pct"), default="bounded",
                         help="bounded: every schedule within --bound preemptions, fewest first (default); pct: "
                              "--runs randomised priority schedules from --seed, for bugs of --depth")
    explore.add_argument("--bound", type=int, default=2, help="preemption bound for 'bounded' (default 2)")
    explore.add_argument("--seed", type=int, default=0, help="first PCT seed")
    explore.add_argument("--runs", type=int, default=200, help="PCT runs")
    explore.add_argument("--depth", type=int, default=2, help="PCT bug depth")
    explore.add_argument("--count-all", action="store_true", help="run the whole bound and count losing schedules")
    explore.add_argument("--no-shrink", action="store_true", help="keep the schedule exactly as found")
    explore.add_argument("--save", type=Path, default=None, help="write the losing schedule to this file")
    explore.add_argument("--max-executions", type=int, default=100_000, help="execution budget (default 100000)")
    explore.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                         help="stop searching after this long (exit 3 if nothing was found)")


def _ints(text: str, what: str) -> list[int]:
    parts = text.split(",")
    if any(not x.strip() for x in parts):  # ("2,,4" was read as 2,4)
        raise InvalidRequestError(f"{what} must be a comma list of integers, got {text!r} (an empty item)")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        raise InvalidRequestError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InvalidRequestError(f"{what} must be positive integers")
    return values


def _check_output(path: Path | None, option: str, *, plot: bool = False) -> None:
    """A file the command writes at its end, checked before the work (the race lab's writers make
    its missing folders)."""
    from isolab.commands.outputs import check_output_path

    check_output_path(path, option, make_parents=True, plot=plot)


def _stress(args: argparse.Namespace) -> int:
    from isolab.race import report
    from isolab.race.checkers import VARIANTS, parse_variants
    from isolab.race.stress import StressConfig, sweep

    variants = parse_variants(args.variant)
    if not variants:
        raise InvalidRequestError(f"--variant {args.variant!r} names no variant (try buggy, a comma list, or all)")
    thread_counts = _ints(args.threads, "--threads")
    if args.repeat < 1:
        raise InvalidRequestError("--repeat must be at least 1")
    for n in thread_counts:  # validate before the first run
        config = StressConfig(n, args.requests, args.right_share, args.switch_interval)
        if n > 1 and config.num_right_threads in (0, n):  # (buggy was graded OK: no race could show)
            kind = "right" if config.num_right_threads else "wrong"
            print(f"isolab: warning: at {n} threads, --right-share {args.right_share:g} has every thread send the "
                  f"{kind} passcode: no false accept or reject can happen there", file=sys.stderr)
    _check_output(args.json, "--json")
    _check_output(args.plot, "--plot", plot=True)

    def progress(r) -> None:
        print(f"  {r.variant:<20} threads={r.threads:<3} run {r.repeat + 1}: false accepts {r.false_accepts:>5}, "
              f"false rejects {r.false_rejects:>5}, {r.qps:>9.0f} QPS", file=sys.stderr, flush=True)

    results = sweep(variants, thread_counts, args.requests, args.repeat, args.right_share, args.switch_interval, progress)
    print(report.table(results))
    print()
    print(report.histogram(results))
    command = "isolab race stress " + " ".join(shlex.quote(a) for a in sys.argv[3:]) if len(sys.argv) > 2 else ""
    if args.json:
        report.write_json(args.json, results, command)
        print(f"\nwrote {args.json}")
    if args.plot:
        interval = args.switch_interval or "default (5 ms)"
        written = report.plot(args.plot, results, f"{args.requests:,} requests per run, switch interval {interval}")
        print(f"wrote {written}")
    # like jcstress: a FORBIDDEN outcome in a variant that claims to be a fix fails the run
    forbidden = any(r.false_accepts + r.false_rejects for r in results if not VARIANTS[r.variant].racy)
    return 1 if forbidden else 0


def _explore(args: argparse.Namespace) -> int:
    from isolab.commands.common import flags_set
    from isolab.race.explorer import scenario as scenarios
    from isolab.race.explorer_cli import limits_of, run_explore, run_replay

    searching = dict((dest, option) for option, dest in flags_set(args, _add_search_args))  # away from defaults
    if args.list:
        if args.target is not None or searching or args.replay is not None:  # (they were ignored)
            raise InvalidRequestError("--list prints the built-in targets: give it alone")
        print("\n".join(scenarios.builtin_names()))
        return 0
    if args.replay is None:  # (a replay refuses every search flag below, with its own sentence)
        # flags one strategy reads and the other would ignore without a word
        pct_only = [searching[d] for d in ("seed", "runs", "depth") if d in searching and args.strategy != "pct"]
        if pct_only:
            raise InvalidRequestError(f"{pct_only[0]} is read only with --strategy pct", field="strategy")
        if "bound" in searching and args.strategy == "pct":
            raise InvalidRequestError("--bound is read only with --strategy bounded (pct has --depth)", field="bound")
        if args.times != REPLAY_TIMES:
            raise InvalidRequestError("--times is read only with --replay", field="times")
    for flag, value, least in (("--bound", args.bound, 0), ("--times", args.times, 1), ("--runs", args.runs, 1),
                               ("--depth", args.depth, 1)):
        if value < least:
            raise InvalidRequestError(f"{flag} must be at least {least}, not {value}", field=flag.lstrip("-"))
    seconds = [args.stall_seconds] + ([args.time_limit] if args.time_limit is not None else [])
    if min(args.max_executions, args.max_steps, args.max_bytecodes) < 1 \
            or not all(0 < x < math.inf for x in seconds):  # (NaN fails a comparison: it got through `<= 0`)
        raise InvalidRequestError("--max-executions, --max-steps, --max-bytecodes, --time-limit and --stall-seconds "
                                  "must be positive (the seconds finite)")
    for name in args.trace_module:  # ("" and ".x" were tracebacks from importlib)
        if not all(part.isidentifier() for part in name.split(".")):
            raise InvalidRequestError(f"--trace-module {name!r} is not a module name (e.g. mypkg.accounts)")
    if args.replay is not None:
        found = flags_set(args, _add_search_args)
        if found:  # (they were ignored without a word)
            raise InvalidRequestError(f"{found[0][0]} belongs to a search; --replay follows its schedule file, which "
                                      "fixes the switch mode and every step")
    _check_output(args.save, "--save")
    if args.replay is not None:
        return run_replay(args.target, args.replay, args.times, limits_of(args), args.trace_module)
    if not args.target:
        raise InvalidRequestError("explore needs a TARGET (try --list)")
    return run_explore(args)


def _bench(args: argparse.Namespace) -> int:
    from isolab.race.bench import run_bench
    from isolab.race.stress import StressConfig

    if args.repeat < 1:
        raise InvalidRequestError("--repeat must be at least 1")
    StressConfig(args.threads, args.requests)  # --threads and --requests, before the first run
    _check_output(args.json, "--json")
    run_bench(args.requests, args.repeat, args.threads, args.json)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from isolab.race.service import serve_forever

    return serve_forever(args.variant, args.host, args.port, args.max_attempts, args.window, args.scrypt_n,
                         quiet=args.quiet)
