"""Owns `isolab bench`: the engine benchmark (or, with --url, the same workload over HTTP)."""

from __future__ import annotations

import argparse
import json
import math
import platform

from isolab.commands.common import add_engine_args, engine_flags_set, flags_set, llm_kwargs


def _range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LO:HI") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return a, b


def _whole(minimum: int):
    """An argparse type: a whole number of at least `minimum`, else one sentence."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: need at least {minimum}" if minimum else f"{text!r}: need 0 or more")
        return n

    return parse


_positive, _at_least_zero = _whole(1), _whole(0)


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: need a positive number of seconds")
    return x


def _share(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: need a share between 0 and 1")
    return x


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="throughput and latency of the engine (or of any server, with --url)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=_positive, default=32)
    w.add_argument("--concurrency", type=_positive, default=32)
    w.add_argument("--prompt-len", type=_range, default=(64, 256), help="prompt words, N or LO:HI (64:256)")
    w.add_argument("--output-len", type=_range, default=(128, 128), help="new tokens, N or LO:HI (128)")
    w.add_argument("--shared-prefix-len", type=_at_least_zero, default=0, help="words of a shared prefix")
    w.add_argument("--shared-fraction", type=_share, default=0.0, help="share of prompts with the prefix, 0 to 1")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", choices=["hf"], default=None, help="also run transformers' batched generate")
    p.add_argument("--repeats", type=_positive, default=1,
                   help="run the engine's workload N times, each on a fresh engine (an empty prefix cache), "
                        "interleaved with --compare's peer: each pair and the median are reported (1)")
    p.add_argument("--url", default=None, help="bench an OpenAI-compatible server instead of the engine")
    _add_request_args(p)
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    add_engine_args(p)
    p.set_defaults(func=run)


def _refuse_engine_flags(args: argparse.Namespace) -> None:
    """With --url no engine runs here: an engine flag set away from its default would be silently
    ignored, so it is refused in one sentence (it belongs on the server's command line)."""
    from isolab.errors import InvalidRequestError

    found = engine_flags_set(args)
    if found:
        option, dest = found[0]
        raise InvalidRequestError(f"{option} sets up an engine, and with --url none runs here: give it to the "
                                  f"server's command", field=dest)


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """The flags that shape the requests sent to a server (--url's)."""
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model", default=None, help="model name to send with --url")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="with --url: for servers without `ignore_eos` (llama.cpp); pair with --extra-body")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help='with --url: fields merged into every request, e.g. \'{"logit_bias": {"2": -100}}\'')
    p.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="with --url: seconds to wait for a connection or for each part of a stream (600)")


def _refuse_url_flags(args: argparse.Namespace) -> None:
    """Without --url the engine runs here: the flags that shape requests to a server (each set away
    from its default) would be silently ignored, so they are refused in one sentence."""
    from isolab.errors import InvalidRequestError

    for option, dest in flags_set(args, _add_request_args)[:1]:
        raise InvalidRequestError(f"{option} shapes the requests sent to a server: it needs --url "
                                  "(without it the engine runs in this process)", field=dest)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from isolab.bench.workload import WorkloadSpec, make_workload
    from isolab.commands.outputs import check_output_path

    check_output_path(args.json, "--json")  # before the run: its figures were lost to a path checked at the end

    wl = make_workload(WorkloadSpec(args.num_requests, args.prompt_len, args.output_len, args.shared_prefix_len,
                                    args.shared_fraction, args.seed))
    result: dict = {"workload": vars(wl.spec), "machine": {"cpu_threads": torch.get_num_threads(),
                                                           "platform": platform.platform()}}
    if args.url:
        from isolab.bench.http_bench import run_http_bench
        from isolab.errors import InvalidRequestError, IsolabError

        if args.repeats != 1 or args.compare:
            raise InvalidRequestError("--repeats and --compare run the engine in this process, not a server: with "
                                      "--url, run `isolab bench --url` once for each server and compare their --json "
                                      "files", field="url")
        _refuse_engine_flags(args)
        from isolab.base_url import check_base_url

        check_base_url(args.url, "--url")
        try:
            extra = json.loads(args.extra_body) if args.extra_body else None
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"--extra-body is not JSON ({exc})", field="extra_body") from None
        if extra is not None and not isinstance(extra, dict):
            raise InvalidRequestError(f"--extra-body must be a JSON object of request fields, not {args.extra_body}",
                                      field="extra_body")
        result["server"] = run_http_bench(args.url, args.api_key, args.served_model, wl.prompts, wl.max_tokens,
                                          args.concurrency, ignore_eos=not args.no_ignore_eos, extra_body=extra,
                                          timeout_s=args.timeout)
        if result["server"]["completed"] == 0:
            raise IsolabError(f"no request completed against {args.url}: {(result['server']['errors'] or ['?'])[0]}")
        rows = [("server", result["server"])]
    else:
        _refuse_url_flags(args)
        rows = _engine_runs(args, wl, result)
    table = Table(title=f"isolab bench: {args.num_requests} requests, concurrency {args.concurrency}")
    for col in ("system", "output tok/s", "TTFT p50 / p99 (s)", "ITL p50 / p99 (ms)", "prefix hit rate", "peak RSS (MiB)"):
        table.add_column(col)

    def f(d, k, scale=1.0, fmt="{:.3f}"):
        v = (d or {}).get(k)
        return "-" if v is None else fmt.format(v * scale)

    for name, d in rows:
        ttft, itl = d.get("ttft_s") or d.get("request_latency_s"), d.get("itl_s")
        table.add_row(name, f"{d['output_tokens_per_s']:.1f}", f"{f(ttft, 'p50')} / {f(ttft, 'p99')}",
                      f"{f(itl, 'p50', 1e3, '{:.1f}')} / {f(itl, 'p99', 1e3, '{:.1f}')}",
                      f(d, "prefix_cache_hit_rate", 1, "{:.0%}"), f(d, "peak_rss_mib", 1, "{:.0f}"))
    console = Console()
    console.print(table)
    if "runs" in result:
        each = ", ".join(f"{r['engine']['output_tokens_per_s']:.1f}" for r in result["runs"])
        console.print(f"isolab output tokens/s, median of {len(result['runs'])} runs: "
                      f"{result['engine']['output_tokens_per_s']:.1f} (each run: {each})")
    if "ratio_vs_hf" in result:
        pairs = result.get("ratios_vs_hf", [result["ratio_vs_hf"]])
        each = f" (median of {len(pairs)} pairs: {', '.join(f'{r:.2f}' for r in pairs)})" if len(pairs) > 1 else ""
        console.print(f"isolab / transformers output tokens/s: {result['ratio_vs_hf']:.2f}x{each}")
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        except OSError as exc:  # (a full disk, /dev/full: the figures are printed above)
            from isolab.errors import InvalidRequestError

            raise InvalidRequestError(f"--json {args.json}: cannot write it ({exc.strerror or exc}); the figures "
                                      "are in the table above", field="json") from None
    return 0


def _engine_runs(args: argparse.Namespace, wl, result: dict) -> list[tuple[str, dict]]:
    """The engine's workload `--repeats` times, each on a fresh engine, each followed by the peer's
    run when --compare asks for one (the pair shares the machine's mood). One run: result["engine"]
    (and result["hf"]) are its figures; more: result["runs"] holds every run, result["engine"] and
    result["hf"] the run with the median tok/s (the engine's peak RSS: the first run's, taken before
    transformers loaded), and ratio_vs_hf the median of the pairs' ratios."""
    import statistics

    from isolab.bench.engine_bench import load_hf, run_engine_bench, run_hf_bench
    from isolab.llm import LLM

    hf = None
    runs: list[dict] = []
    for i in range(args.repeats):
        llm = LLM(**llm_kwargs(args))  # a fresh engine: its own KV pool, an empty prefix cache
        run = {"engine": run_engine_bench(llm.engine, wl, args.concurrency)}
        run["engine"]["dtype"] = args.dtype
        weights = run["engine"]["weights"] = llm.engine.bundle.weights
        run["engine"]["kv_cache_dtype"] = args.kv_cache_dtype
        if i:  # the process's peak now holds transformers' model too: only the first run's is the engine's
            run["engine"]["peak_rss_mib"] = None
        llm.engine.close()
        if args.compare == "hf":
            hf = hf or load_hf(args.model, args.dtype)
            run["hf"] = run_hf_bench(args.model, args.dtype, wl, args.concurrency, loaded=hf)
            run["ratio_vs_hf"] = run["engine"]["output_tokens_per_s"] / run["hf"]["output_tokens_per_s"]
        runs.append(run)

    def median_run(key: str) -> dict:
        ordered = sorted((r[key] for r in runs), key=lambda d: d["output_tokens_per_s"])
        return ordered[(len(ordered) - 1) // 2]

    result["engine"] = {**median_run("engine"), "peak_rss_mib": runs[0]["engine"]["peak_rss_mib"]}
    pool = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} K/V pool"
    rows = [(f"isolab ({args.dtype}, {weights} weights{pool})", result["engine"])]
    if hf is not None:
        result["hf"] = median_run("hf")
        result["ratio_vs_hf"] = statistics.median(r["ratio_vs_hf"] for r in runs)
        rows.append((f"transformers ({args.dtype}, static batch {args.concurrency})", result["hf"]))
    if len(runs) > 1:
        result["runs"] = runs
        if hf is not None:
            result["ratios_vs_hf"] = [r["ratio_vs_hf"] for r in runs]
        rows = [(f"{name}, median of {len(runs)}", d) for name, d in rows]
    return rows
