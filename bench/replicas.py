"""Scale-out on Ray Serve, measured: affinity against random routing, and throughput with replicas.

    .venv/bin/python bench/replicas.py [--prefixes 32] [--concurrency 32] [--requests 64]

One server at a time, each `isolab serve` started as a user starts it, stopped with SIGTERM:
1. Affinity: 2 replicas, routing affinity, then random. A tenant sends `--prefixes` distinct prompts
   (about 100 tokens each), then each again with another question: the share of repeats that get
   cached tokens (the repeat reached the replica holding its prefix).
2. Throughput: the same streamed workload (`isolab bench --url`: prompts of 64-256 words, 128 new
   tokens) against one in-process engine with 2 threads, 1 Ray replica with 2 threads, 1 with 1
   thread, and 2 replicas of 1 thread each. On a 2-core machine replicas share the cores: the
   figures show the cost of the Ray hop and what splitting the cores does, not multi-node scaling.
   The projection for a node per replica is N times the 1-thread replica alone (docs/scaleout.md).
Writes bench/results/replicas.json. Needs the ray extra (pip install 'isolab[ray]').
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from isolab.testing.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="isolab-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "isolab.cli", "serve", "--no-auth", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.args = list(args)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`isolab serve {' '.join(args)}` exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 300:
                raise RuntimeError("the server did not come up in 300 s")
            time.sleep(0.5)
        self.start_s = time.monotonic() - t0
        time.sleep(1.0)  # the first stats poll

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()


def repeat_hit_rate(server: Server, num_prefixes: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    prompts = [f"Instructions for assistant {i}: you answer questions about topic {i} in {i % 7 + 2} sentences, "
               f"politely, with one example, and you never repeat the question. Topic {i} matters. " * 2
               for i in range(num_prefixes)]
    cached = []
    for rep in range(2):
        for p in prompts:
            r = client.completions.create(model=model, prompt=p + f"Question {rep}: why?", max_tokens=2, temperature=0)
            if rep == 1:
                d = r.usage.prompt_tokens_details
                cached.append((d.cached_tokens or 0) if d else 0)
    return {"repeats": len(cached), "repeats_with_cached_tokens": sum(c > 0 for c in cached),
            "hit_rate": sum(c > 0 for c in cached) / len(cached), "mean_cached_tokens": sum(cached) / len(cached)}


def throughput(server: Server, requests: int, concurrency: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "isolab.cli", "bench", "--url", server.url, "--num-requests",
                        str(requests), "--concurrency", str(concurrency), "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        s = json.loads(Path(out.name).read_text())["server"]
    return {"output_tokens_per_s": s["output_tokens_per_s"], "completed": s["completed"], "failed": s["failed"],
            "ttft_p50_s": s["ttft_s"]["p50"], "itl_p50_s": s["itl_s"]["p50"], "itl_p99_s": s["itl_s"]["p99"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefixes", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--part", choices=("all", "affinity", "throughput"), default="all",
                   help="run one part; the other's figures in --out are kept")
    p.add_argument("--out", default=str(ROOT / "bench/results/replicas.json"))
    args = p.parse_args()
    try:
        import ray  # noqa: F401
    except ImportError:
        print("bench/replicas.py needs the ray extra: pip install 'isolab[ray]'")
        return 0
    out = Path(args.out)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() and args.part != "all" else {}
    result.update({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "workload": vars(args)})
    if args.part in ("all", "affinity"):
        result["affinity"] = affinity(args.prefixes)
    if args.part in ("all", "throughput"):
        result["throughput"] = scaling(args.requests, args.concurrency)
        base = result["throughput"]["1 replica x 2 threads"]["output_tokens_per_s"]
        tp = result["throughput"]
        result["ratio_2x1_over_1x2"] = tp["2 replicas x 1 thread"]["output_tokens_per_s"] / base
        # a node per replica, each with the one core a 1-thread replica has here: N times that replica alone
        result["projected_one_core_per_replica"] = {
            str(n): n * tp["1 replica x 1 thread"]["output_tokens_per_s"] for n in (1, 2, 4, 8)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| routing (2 replicas) | repeats hitting the cache |\n|---|---|")
    for routing, f in result.get("affinity", {}).items():
        print(f"| {routing} | {f['repeats_with_cached_tokens']}/{f['repeats']} ({f['hit_rate']:.0%}) |")
    print("\n| server | tok/s | ITL p50 | TTFT p50 | start |\n|---|---|---|---|---|")
    for name, f in result.get("throughput", {}).items():
        print(f"| {name} | {f['output_tokens_per_s']:.1f} | {f['itl_p50_s'] * 1000:.0f} ms | "
              f"{f['ttft_p50_s']:.2f} s | {f['start_s']} s |")
    print(f"\nwrote {out}")
    return 0


def affinity(num_prefixes: int) -> dict[str, Any]:
    figures = {}
    for routing in ("affinity", "random"):
        s = Server("--replicas", "2", "--routing", routing)
        try:
            figures[routing] = repeat_hit_rate(s, num_prefixes)
        finally:
            s.stop()
        print(f"2 replicas, routing {routing}: {figures[routing]}", flush=True)
    return figures


def scaling(requests: int, concurrency: int) -> dict[str, Any]:
    figures = {}
    for name, server_args in (("one engine, 2 threads (no Ray)", ()),
                              ("1 replica x 2 threads", ("--replicas", "1", "--replica-threads", "2")),
                              ("1 replica x 1 thread", ("--replicas", "1", "--replica-threads", "1")),
                              ("2 replicas x 1 thread", ("--replicas", "2", "--replica-threads", "1"))):
        s = Server(*server_args)
        try:
            figures[name] = throughput(s, requests, concurrency)
            figures[name]["start_s"] = round(s.start_s, 1)
        finally:
            s.stop()
        print(f"{name}: {figures[name]}", flush=True)
    return figures


if __name__ == "__main__":
    sys.exit(main())
