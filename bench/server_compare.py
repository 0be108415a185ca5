"""isolab's server and llama-cpp-python's server side by side: the same GGUF, the same streamed
workload over HTTP, one server at a time on this machine. Prints a table and writes
bench/results/server_compare.json.

    .venv/bin/python bench/server_compare.py [--concurrency 32] [--requests 64] [--max-tokens 128]

llama-cpp-python's server is skipped (and said so) when `llama_cpp` is not installed
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
            concurrency: int, log_dir: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ISOLAB_API_KEYS", None)
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_up(url, proc)
            run_http_bench(url, None, None, prompts[:2], [8, 8], 2)  # warm-up
            result = run_http_bench(url, None, None, prompts, max_tokens, concurrency)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result["server"] = name
    result["command"] = " ".join(cmd[1:])
    return result


def row(r: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    t = r["ttft_s"]
    return (f"{r['server']:<18} {r['output_tokens_per_s']:>9.1f} {r['output_tokens']:>7} {r['completed']:>4}/"
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
    log_dir = args.json.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    results = []
    port = free_port()
    results.append(measure("isolab", [py, "-m", "isolab.cli", "serve", "--no-auth", "--port", str(port),
                                      "--model", str(gguf), "--log-level", "warning"],
                           port, prompts, max_tokens, args.concurrency, log_dir))
    skipped = None
    if args.skip_llama:
        skipped = "--skip-llama"
    elif importlib.util.find_spec("llama_cpp") is None:
        skipped = "llama_cpp is not installed"
    else:
        port = free_port()
        results.append(measure("llama-cpp-python", [py, "-m", "llama_cpp.server", "--model", str(gguf),
                                                    "--port", str(port), "--n_ctx", "4096",
                                                    "--n_threads", str(args.threads)],
                               port, prompts, max_tokens, args.concurrency, log_dir))
    print(f"{'server':<18} {'out tok/s':>9} {'tokens':>7} {'done':>9} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} "
          f"{'itl50':>7}   (ms)")
    for r in results:
        print(row(r))
    ratio = None
    if len(results) == 2 and results[1]["output_tokens_per_s"] > 0:
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        print(f"isolab / llama-cpp-python aggregate output tokens/s: {ratio:.2f}x")
    if skipped:
        print(f"llama-cpp-python skipped: {skipped}")
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg()},
        "model": gguf.name,
        "workload": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "temperature": 0.0, "stream": True, "ignore_eos": True},
        "results": results,
        "isolab_over_llama_cpp_python": ratio,
        "llama_cpp_python_skipped": skipped,
    }
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
