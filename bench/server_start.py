"""How long `isolab serve` takes to answer /health, and what it holds then, from one or more trees.

Each run starts a fresh `python -m isolab.cli serve` on loopback with the tree's `isolab` first on
PYTHONPATH (this venv's packages for everything else), polls /health every 50 ms, then reads the
process's RSS two seconds later (idle) and its peak (VmHWM) from /proc, times three chat requests
of 16 tokens one after another (the first pays what a start leaves to first use), reads the RSS
again, and stops it. Trees take
turns, each round starting with the next one, so a drift of the machine does not always land on
the same tree. Comparing a change with the commit before it:

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/server_start.py --tree before=/tmp/before --tree after=. [--model gemma3-270m]
        [--weights dense]

Writes bench/results/server_start_MODEL.json (or --json). Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from single_stream import chat_once, rss_mib, served_model  # (bench/ is the script's directory)

from isolab.testing.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def one_start(tree: Path, model: str | None, timeout: float, weights: str | None = None) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "isolab.cli", "serve", "--port", str(port), "--no-auth", "--log-level", "warning",
           *(["--model", model] if model else []), *(["--weights", weights] if weights else [])]
    log = tempfile.TemporaryFile(mode="w+")  # (a pipe nobody reads could fill and stall the server)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"the server from {tree} exited with {proc.returncode}: {log.read()[-2000:]}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"the server from {tree} did not answer /health in {timeout:.0f} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        time.sleep(2.0)
        idle, peak = rss_mib(proc.pid)
        # the first requests after the start (the first pays what was left to first use: mapped
        # weight pages, lazily built state); 16 tokens each
        base = f"http://127.0.0.1:{port}"
        model_id = served_model(base)
        request_ms = []
        for _ in range(3):
            t = time.perf_counter()
            chat_once(base, model_id)
            request_ms.append(round((time.perf_counter() - t) * 1e3, 1))
        return {"ready_s": round(ready, 2), "idle_rss_mib": idle, "peak_rss_mib": peak,
                "first_requests_ms": request_ms, "served_rss_mib": rss_mib(proc.pid)[0]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=None, metavar="NAME=PATH",
                    help="a checkout to start the server from (repeatable; default: this one, as 'this')")
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default=None, help="passed to `isolab serve` (native, dense)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trees: dict[str, Path] = {}
    for spec in args.tree or [f"this={ROOT}"]:
        name, sep, path = spec.partition("=")
        tree = Path(path).resolve()
        if not sep or not name or not (tree / "isolab" / "cli.py").is_file():
            ap.error(f"--tree {spec!r}: expected NAME=PATH to a checkout of isolab")
        trees[name] = tree
    names = list(trees)
    runs = []
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = {"tree": name, **one_start(trees[name], args.model, args.timeout, args.weights)}
            runs.append(run)
            print(f"round {r} {name}: ready in {run['ready_s']:.2f} s, idle RSS {run['idle_rss_mib']} MiB, "
                  f"peak {run['peak_rss_mib']} MiB; requests {run['first_requests_ms']} ms, then "
                  f"{run['served_rss_mib']} MiB", flush=True)
    median = {n: {k: statistics.median(x[k] for x in runs if x["tree"] == n)
                  for k in ("ready_s", "idle_rss_mib", "peak_rss_mib", "served_rss_mib")} for n in names}
    for n in names:
        median[n]["first_request_ms"] = statistics.median(x["first_requests_ms"][0] for x in runs if x["tree"] == n)
        median[n]["later_requests_ms"] = round(statistics.median(v for x in runs if x["tree"] == n
                                                                 for v in x["first_requests_ms"][1:]), 1)
    for n in names:
        m = median[n]
        print(f"{n}: median ready {m['ready_s']:.2f} s, idle {m['idle_rss_mib']} MiB, peak {m['peak_rss_mib']} MiB, "
              f"first request {m['first_request_ms']} ms, later ones {m['later_requests_ms']} ms, then "
              f"{m['served_rss_mib']} MiB")
    commits = {n: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for n, t in trees.items()}
    from isolab.models.invariance import cpu_description  # (imports torch: after the timed starts)

    cpu = cpu_description()
    out = Path(args.json or ROOT / f"bench/results/server_start_{args.model or 'default'}.json")
    out.write_text(json.dumps({"model": args.model, "weights": args.weights, "cpu": cpu,
                               "trees": {n: str(t) for n, t in trees.items()}, "commits": commits, "rounds": args.rounds, "median": median, "runs": runs}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
