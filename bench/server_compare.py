"""isolab's server and llama-cpp-python's server side by side: the same GGUF, the same streamed
workload over HTTP, one server at a time on this machine. Prints a table and writes
bench/results/server_compare.json.

    .venv/bin/python bench/server_compare.py [--concurrency 32] [--requests 64] [--max-tokens 128]

llama-cpp-python's server runs with --interrupt_requests False: by default a new request cuts off
the one being streamed, which would count as "done" after a token or two. It is skipped (and said so) when `llama_cpp` is not installed
(`.venv/bin/pip install 'llama-cpp-python[server]'` builds it from source in about 5 minutes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from isolab.bench.http_bench import run_http_bench
from isolab.models.locate import default_model_path

TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "copper", "tea", "glaciers", "violins", "bees",
          "deserts", "clocks", "salt", "comets", "maps", "ferns", "ink", "trains", "coral", "wool",
          "volcanoes", "kites", "lenses", "honey", "bridges", "whales", "paper", "storms", "gardens", "rust",
          "mirrors", "lanterns"]


EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>: llama-cpp-python has no ignore_eos, so it gets a logit bias


def workload(num_requests: int, max_tokens: int) -> tuple[list[str], list[int]]:
    prompts = [f"Write a short essay about {TOPICS[i % len(TOPICS)]}, part {i // len(TOPICS) + 1}.\n\n"
               for i in range(num_requests)]
    return prompts, [max_tokens] * num_requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def measure(name: str, cmd: list[str], port: int, prompts: list[str], max_tokens: list[int],
            concurrencies: list[int], log_dir: Path, no_eos: dict[str, Any]) -> list[dict[str, Any]]:
    """One server process, the workload once per concurrency. `no_eos`: the request fields that make
    this server run to max_tokens, so both servers do the same work."""
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ISOLAB_API_KEYS", None)
    results = []
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_up(url, proc)
            run_http_bench(url, None, None, prompts[:2], [8, 8], 2, ignore_eos=False, extra_body=no_eos)  # warm-up
            for c in concurrencies:
                r = run_http_bench(url, None, None, prompts, max_tokens, c, ignore_eos=False, extra_body=no_eos)
                r["server"] = f"{name} x{c}"
                r["command"] = " ".join(cmd[1:])
                r["ran_to_max_tokens"] = r["output_tokens"] == sum(max_tokens)
                results.append(r)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return results


def row(r: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    t = r["ttft_s"]
    return (f"{r['server']:<22} {r['output_tokens_per_s']:>9.1f} {r['output_tokens']:>7} {r['completed']:>4}/"
            f"{r['num_requests']:<4} {ms(t['p50']):>7} {ms(t['p90']):>7} {ms(t['p99']):>7} {ms(r['itl_s']['p50']):>7}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "server_compare.json")
    args = p.parse_args()
    gguf = default_model_path()
    prompts, max_tokens = workload(args.requests, args.max_tokens)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="server_compare-"))  # the servers' own logs
    print(f"server logs in {log_dir}")
    py = sys.executable
    results = []
    port = free_port()
    results += (measure("isolab", [py, "-m", "isolab.cli", "serve", "--no-auth", "--port", str(port),
                                      "--model", str(gguf), "--log-level", "warning"],
                           port, prompts, max_tokens, [args.concurrency], log_dir, {"ignore_eos": True}))
    skipped = None
    if args.skip_llama:
        skipped = "--skip-llama"
    elif importlib.util.find_spec("llama_cpp") is None:
        skipped = "llama_cpp is not installed"
    else:
        port = free_port()
        # at the same concurrency, and with one client: it serves one request at a time, so one
        # client is its ceiling (at 32 clients its streams stall while others wait for its lock)
        results += (measure("llama-cpp-python", [py, "-m", "llama_cpp.server", "--model", str(gguf),
                                                    "--port", str(port), "--n_ctx", "4096", "--interrupt_requests", "False",
                                                    "--n_threads", str(args.threads)],
                               port, prompts, max_tokens, sorted({args.concurrency, 1}, reverse=True), log_dir,
                               {"logit_bias": {str(EOS_TOKEN_ID): -100.0}}))
    print(f"{'server':<22} {'out tok/s':>9} {'tokens':>7} {'done':>9} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} "
          f"{'itl50':>7}   (ms)")
    for r in results:
        print(row(r))
    ratio = None
    best_llama = max((r["output_tokens_per_s"] for r in results[1:]), default=0.0)
    if best_llama > 0:
        ratio = results[0]["output_tokens_per_s"] / best_llama
        print(f"isolab x{args.concurrency} / llama-cpp-python at its best: {ratio:.2f}x aggregate output tokens/s")
    if skipped:
        print(f"llama-cpp-python skipped: {skipped}")
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg()},
        "model": gguf.name,
        "workload": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "temperature": 0.0, "stream": True,
                     "run_to_max_tokens": "isolab: ignore_eos; llama-cpp-python: logit_bias -100 on EOS"},
        "results": results,
        "isolab_over_best_llama_cpp_python": ratio,
        "llama_cpp_python_skipped": skipped,
    }
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
