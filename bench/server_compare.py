"""isolab's server beside llama.cpp's servers: the same GGUF, the same streamed workload over HTTP,
one server at a time on this machine. Prints a table and writes bench/results/server_compare_peers.json
(bench/results/server_compare.json is the first version's run, against llama-cpp-python only).

    .venv/bin/python bench/server_compare.py [--concurrency 1,32,128] [--requests N] [--max-tokens 128]
                                             [--prompt-words LO:HI] [--model PATH] [--llama-server PATH]

Peers, each skipped with a sentence when it is not here:
- llama.cpp's own `llama-server` (C++: parallel slots, continuous batching; the throughput peer).
  Found at --llama-server, $LLAMA_SERVER, or where ../shared/tools/build_llama_server.sh puts it
  (~/.cache/llama-server). It runs per concurrency C with C slots (`--parallel C`), each with its own
  --slot-ctx tokens of KV (its default when --parallel is given: with one unified buffer,
  --kv-unified, its log showed 4.7 s a step at 128 slots here), --threads and --threads-batch as
  given, and `--no-repack` (its AMX repacking crashes on Intel VMs with AMX; on x86 its repacking
  covers Q4_0, IQ4_NL, Q4_K, MXFP4 and Q2_K only; --llama-repack lets it repack, on a CPU without
  AMX); requests carry `ignore_eos`.
- llama-cpp-python's server (`python -m llama_cpp.server`), with --interrupt_requests False: by
  default a new request cuts off the one being streamed, which would count as "done" after a token
  or two. It serves one request at a time, so it runs at 1 client and at the smallest concurrency
  above 1. EOS gets a -100 logit bias (it has no ignore_eos).

isolab runs with its defaults, one process for every concurrency; its requests carry ignore_eos, so
every server runs every request to --max-tokens (the JSON says whether each did). The workload is
--requests prompts (default 2 x C at each concurrency C, at least 8): short essay prompts, or with
--prompt-words LO:HI the engine bench's random-word prompts (`isolab bench`'s workload, seed 0).
The bench client shares the machine's cores with the server under test, the same for each.
"""

from __future__ import annotations

import argparse
import importlib.util
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

from isolab.bench.http_bench import run_http_bench
from isolab.bench.workload import WorkloadSpec, make_workload
from isolab.models.locate import resolve_model_path
from isolab.testing.live_server import free_port

TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "copper", "tea", "glaciers", "violins", "bees",
          "deserts", "clocks", "salt", "comets", "maps", "ferns", "ink", "trains", "coral", "wool",
          "volcanoes", "kites", "lenses", "honey", "bridges", "whales", "paper", "storms", "gardens", "rust",
          "mirrors", "lanterns"]


EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>: llama-cpp-python has no ignore_eos, so it gets a logit bias
LLAMA_SERVER_CACHE = Path.home() / ".cache" / "llama-server"


def workload(num_requests: int, max_tokens: int, prompt_words: tuple[int, int] | None) -> tuple[list[str], list[int]]:
    if prompt_words:
        wl = make_workload(WorkloadSpec(num_requests, prompt_words, (max_tokens, max_tokens)))
        return wl.prompts, wl.max_tokens
    prompts = [f"Write a short essay about {TOPICS[i % len(TOPICS)]}, part {i // len(TOPICS) + 1}.\n\n"
               for i in range(num_requests)]
    return prompts, [max_tokens] * num_requests


def find_llama_server(given: str | None) -> Path | None:
    """--llama-server, $LLAMA_SERVER, or the build script's output under ~/.cache/llama-server."""
    for cand in (given, os.environ.get("LLAMA_SERVER")):
        if cand:
            return Path(cand)
    def version(path: Path) -> tuple[int, ...]:  # llama_cpp_python-0.3.36 -> (0, 3, 36)
        tail = path.parts[len(LLAMA_SERVER_CACHE.parts)].rpartition("-")[2]
        return tuple(int(x) for x in tail.split(".") if x.isdigit())

    found = sorted(LLAMA_SERVER_CACHE.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"), key=version)
    return found[-1] if found else None


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


def rss_mib(pid: int) -> float | None:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmRSS"):
                return round(int(ln.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class DidNotStart(Exception):
    """A server under test exited or did not answer; the message names its log."""


def measure(name: str, cmd: list[str], port: int, loads: list[tuple[int, list[str], list[int]]],
            log_dir: Path, no_eos: dict[str, Any]) -> list[dict[str, Any]]:
    """One server process, each (concurrency, prompts, max_tokens) load in turn. `no_eos`: the
    request fields that make this server run to max_tokens, so every server does the same work.
    Every request gets its own connection (keepalive=False), for every server: over reused
    keep-alive connections llama-server dropped 2-3 of 32 requests at 16 clients in a probe
    (ServerDisconnected)."""
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ISOLAB_API_KEYS", None)
    results = []
    log_path = log_dir / f"{name}-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            try:
                wait_up(url, proc)
            except RuntimeError as exc:
                raise DidNotStart(f"{name} did not start ({exc}); its log: {log_path}") from None
            run_http_bench(url, None, None, loads[0][1][:2], [8, 8], 2, ignore_eos=False, extra_body=no_eos,
                           keepalive=False)  # warm-up
            idle = rss_mib(proc.pid)
            for c, prompts, max_tokens in loads:
                r = run_http_bench(url, None, None, prompts, max_tokens, c, ignore_eos=False, extra_body=no_eos,
                                   keepalive=False)
                r["server"] = name
                r["command"] = " ".join(Path(cmd[0]).name if i == 0 else a for i, a in enumerate(cmd))
                r["ran_to_max_tokens"] = r["output_tokens"] == sum(max_tokens)
                r["server_rss_mib"] = {"after_warm_up": idle, "after_run": rss_mib(proc.pid)}
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

    t, i = r["ttft_s"], r["itl_s"]
    return (f"{r['server']:<18} {r['concurrency']:>4} {r['output_tokens_per_s']:>9.1f} {r['completed']:>4}/"
            f"{r['num_requests']:<4} {ms(t['p50']):>7} {ms(t['p99']):>7} {ms(i['p50']):>6} {ms(i['p99']):>6}")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range LO:HI of positive ints")
    return a, b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,32,128", help="comma-separated client counts (1,32,128)")
    p.add_argument("--requests", type=int, default=None, help="requests at each concurrency (default 2 x C, at least 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="GGUF path (default: the default model; bench/requantize.py "
                   "writes copies in other block formats)")
    p.add_argument("--prompt-words", type=_range, default=None,
                   help="LO:HI random-word prompts as `isolab bench` sends (default: short essay prompts)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument("--slot-ctx", type=int, default=1024, help="llama-server: KV tokens a slot (x C in all)")
    p.add_argument("--llama-repack", action="store_true",
                   help="let llama-server repack weights (drop --no-repack; its AMX repacking crashes on Intel VMs)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, ~/.cache)")
    p.add_argument("--skip", default="", help="comma-separated peers to leave out: llama-server, llama-cpp-python")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "server_compare_peers.json")
    args = p.parse_args()
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r} is not a comma-separated list of ints")
    if levels[0] < 1:
        p.error("--concurrency: every level must be at least 1")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"llama-server", "llama-cpp-python"}:
        p.error(f"--skip: unknown peer(s) {', '.join(sorted(skip - {'llama-server', 'llama-cpp-python'}))} "
                "(llama-server, llama-cpp-python)")
    gguf = resolve_model_path(args.model)
    binary = find_llama_server(args.llama_server)
    if binary is not None and "llama-server" not in skip and not (binary.is_file() and os.access(binary, os.X_OK)):
        p.error(f"--llama-server / $LLAMA_SERVER: {binary} is not an executable file")

    def load(c: int) -> tuple[int, list[str], list[int]]:
        prompts, max_tokens = workload(args.requests or max(2 * c, 8), args.max_tokens, args.prompt_words)
        return c, prompts, max_tokens

    args.json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="server_compare-"))  # the servers' own logs
    print(f"server logs in {log_dir}")
    py = sys.executable
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    port = free_port()
    try:
        results += measure("isolab", [py, "-m", "isolab.cli", "serve", "--no-auth", "--port", str(port), "--model",
                                      str(gguf), "--log-level", "warning"],
                           port, [load(c) for c in levels], log_dir, {"ignore_eos": True})
    except DidNotStart as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    if "llama-server" in skip:
        skipped["llama-server"] = "--skip"
    elif binary is None:
        skipped["llama-server"] = ("no llama-server binary: build one with ../shared/tools/build_llama_server.sh, "
                                   "or pass --llama-server PATH")
    else:
        try:
            for c in levels:  # a process per concurrency: its slots are fixed at start
                port = free_port()
                results += measure("llama-server", [str(binary), "--model", str(gguf), "--host", "127.0.0.1",
                                                    "--port", str(port), "--parallel", str(c),
                                                    "--ctx-size", str(c * args.slot_ctx), "--threads", str(args.threads),
                                                    "--threads-batch", str(args.threads), "--no-webui",
                                                    *(() if args.llama_repack else ("--no-repack",))],
                                   port, [load(c)], log_dir, {"ignore_eos": True})
        except DidNotStart as exc:
            skipped["llama-server"] = str(exc)

    if "llama-cpp-python" in skip:
        skipped["llama-cpp-python"] = "--skip"
    elif importlib.util.find_spec("llama_cpp") is None:
        skipped["llama-cpp-python"] = "llama_cpp is not installed (.venv/bin/pip install 'llama-cpp-python[server]')"
    else:
        port = free_port()
        # one request at a time: one client is its ceiling, and at more its streams wait for its lock
        cs = sorted({1, min((c for c in levels if c > 1), default=1)})
        try:
            results += measure("llama-cpp-python", [py, "-m", "llama_cpp.server", "--model", str(gguf), "--port",
                                                    str(port), "--n_ctx", "4096", "--interrupt_requests", "False",
                                                    "--n_threads", str(args.threads)],
                               port, [load(c) for c in cs], log_dir, {"logit_bias": {str(EOS_TOKEN_ID): -100.0}})
        except DidNotStart as exc:
            skipped["llama-cpp-python"] = str(exc)

    print(f"{'server':<18} {'C':>4} {'out tok/s':>9} {'done':>9} {'ttft50':>7} {'ttft99':>7} {'itl50':>6} {'itl99':>6}  (ms)")
    for r in results:
        print(row(r))
    ratios: dict[str, dict[str, float]] = {}

    def rates(server: str) -> dict[int, float]:  # only runs that did the whole workload compare
        return {r["concurrency"]: r["output_tokens_per_s"] for r in results
                if r["server"] == server and r["failed"] == 0 and r["ran_to_max_tokens"]}

    for r in results:
        if r["failed"] or not r["ran_to_max_tokens"]:
            print(f"{r['server']} at {r['concurrency']} clients: {r['failed']} requests failed or stopped short "
                  f"({(r['errors'] or ['short of max_tokens'])[0]}); no ratio at this level")
    mine = rates("isolab")
    for peer in ("llama-server", "llama-cpp-python"):
        theirs = rates(peer)
        same = {str(c): round(mine[c] / v, 3) for c, v in theirs.items() if c in mine and v > 0}
        if same:
            ratios[peer] = same
            print(f"isolab / {peer}, output tok/s at the same concurrency: "
                  + ", ".join(f"{c}: {x:.2f}x" for c, x in same.items()))
    for peer, why in skipped.items():
        print(f"{peer} skipped: {why}")
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                                 if ln.startswith("model name")), platform.processor()),
                    "loadavg_at_end": os.getloadavg()},
        "model": gguf.name,
        "workload": {"requests": args.requests or "2 x concurrency, at least 8", "concurrency": levels, "max_tokens": args.max_tokens,
                     "prompts": f"{args.prompt_words[0]}-{args.prompt_words[1]} random words" if args.prompt_words
                     else "short essay prompts", "temperature": 0.0, "stream": True,
                     "run_to_max_tokens": "isolab, llama-server: ignore_eos; llama-cpp-python: logit_bias -100 on EOS"},
        "results": results,
        "isolab_over_peer_same_concurrency": ratios,
        "skipped": skipped,
    }
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
