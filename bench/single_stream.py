"""One conversation at a time: isolab against llama.cpp (llama-cpp-python), same GGUF, same threads.

Each engine runs in its own process (so RSS is its own) and measures, greedy:
  decode tok/s at batch 1 after a short prompt (32 tokens) and after a 1,024-token context,
  prefill of 512 tokens (tok/s), RSS after load (idle) and the peak (VmHWM).
Then each server starts with the same GGUF and its idle RSS is read, and again after one chat
request of 16 tokens: `isolab serve` and `python -m llama_cpp.server`. isolab runs with --weights
native (multiplies on the GGUF blocks) and dense (bf16) for reference. llama.cpp's CPU weight repacking is off (use_extra_bufts=False; it
crashes on AMX VMs). llama-cpp-python is optional: without it the peer is skipped, with a sentence.

    .venv/bin/python bench/single_stream.py [--threads 2] [--json bench/results/single_stream.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

NEW_TOKENS = 128
CONTEXTS = {"short": 32, "ctx1024": 1024}
PREFILL = 512


def rss_mib(pid: int | str = "self") -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    vals = {}
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith(("VmRSS", "VmHWM")):
            k, v = ln.split(":")
            vals[k] = int(v.split()[0]) / 1024
    return round(vals["VmRSS"], 1), round(vals["VmHWM"], 1)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(200, min(vocab, 40000)) for _ in range(n)]  # ordinary tokens, no specials


def worker_isolab(weights: str, threads: int, model: str | None) -> dict:
    import torch

    torch.set_num_threads(threads)
    from isolab.config import build_engine_config
    from isolab.engine.llm_engine import LLMEngine
    from isolab.sampling_params import SamplingParams

    eng = LLMEngine(build_engine_config(model=model, weights=weights, max_num_seqs=4, kv_cache_memory=256 << 20,
                                        max_num_batched_tokens=1024))
    idle = rss_mib()
    vocab = eng.bundle.hparams.vocab_size
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def run(ids: list[int], sp: SamplingParams, rid: str) -> tuple[float, float]:
        eng.add_request(rid, ids, sp)
        t0 = time.perf_counter()
        first = None
        while eng.has_unfinished():
            for out in eng.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        return first - t0, time.perf_counter() - first  # (prefill + first token, the rest)

    run(prompt_ids(vocab, 64, 99), greedy, "warm")
    out: dict = {"engine": "isolab", "weights": eng.bundle.weights, "numerics": eng.model.numerics.numerics}
    for name, n in CONTEXTS.items():
        _, rest = run(prompt_ids(vocab, n, 1), greedy, f"d-{name}")
        out[f"decode_{name}_tok_s"] = round((NEW_TOKENS - 1) / rest, 1)
    best = min(run(prompt_ids(vocab, PREFILL, 10 + i), SamplingParams(max_tokens=1, temperature=0.0), f"p{i}")[0]
               for i in range(3))
    out["prefill_512_tok_s"] = round(PREFILL / best, 1)
    out["rss_idle_mib"], _ = idle
    _, out["rss_peak_mib"] = rss_mib()
    return out


def _no_repack() -> None:
    import llama_cpp.llama_cpp as lc

    default = lc.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False  # llama.cpp's CPU weight repacking: crashes on AMX VMs
        return p

    lc.llama_model_default_params = params


def worker_llama(gguf: str, threads: int) -> dict:
    _no_repack()
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    idle = rss_mib()
    vocab = llm.n_vocab()

    def decode(ids: list[int]) -> float:
        llm.reset()
        llm.eval(ids)
        t0 = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            tok = llm.sample(temp=0.0, top_k=1)
            llm.eval([tok])
        return time.perf_counter() - t0

    decode(prompt_ids(vocab, 64, 99))
    out: dict = {"engine": "llama.cpp", "version": __import__("llama_cpp").__version__}
    for name, n in CONTEXTS.items():
        out[f"decode_{name}_tok_s"] = round((NEW_TOKENS - 1) / decode(prompt_ids(vocab, n, 1)), 1)
    best = 1e9
    for i in range(3):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_ids(vocab, PREFILL, 10 + i))
        best = min(best, time.perf_counter() - t0)
    out["prefill_512_tok_s"] = round(PREFILL / best, 1)
    out["rss_idle_mib"], _ = idle
    _, out["rss_peak_mib"] = rss_mib()
    return out


def served_model(base: str) -> str:
    """The first model id an OpenAI-compatible server at `base` lists."""
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def chat_once(base: str, model: str) -> None:
    """One chat request of 16 new tokens ("Say hello."), read to its end."""
    body = json.dumps({"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]})
    req = urllib.request.Request(base + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def server_rss(cmd: list[str], port: int, path: str, timeout: float = 300) -> tuple[float, float] | None:
    """(idle RSS, RSS after one chat request of 16 tokens) of a server, in MiB; None if it did not come up.
    The second figure counts the weight pages a request touches where a server maps them from a file."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                return None
            try:
                if httpx.get(base + path, timeout=2).status_code == 200:
                    time.sleep(2)  # settle
                    idle = rss_mib(proc.pid)[0]
                    chat_once(base, served_model(base))
                    time.sleep(1)
                    return idle, rss_mib(proc.pid)[0]
            except (httpx.HTTPError, OSError):  # (urllib's errors are OSErrors)
                pass
            time.sleep(0.5)
        return None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


LLAMA_SERVER = ("import sys, runpy; sys.path.insert(0, {bench!r}); from single_stream import _no_repack; _no_repack(); "
                "sys.argv = ['llama_cpp.server'] + sys.argv[1:]; runpy.run_module('llama_cpp.server', run_name='__main__')")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--json", default="bench/results/single_stream.json")
    p.add_argument("--worker", choices=("isolab-native", "isolab-dense", "llama"), help=argparse.SUPPRESS)
    p.add_argument("--skip-servers", action="store_true", help="only the engines, not the servers' idle RSS")
    p.add_argument("--model", default=None, help="a model name (gemma3-270m) or GGUF path (default: SmolLM2-135M)")
    args = p.parse_args()
    from isolab.models.locate import resolve_model_path

    gguf = str(resolve_model_path(args.model))
    if args.worker:
        res = worker_llama(gguf, args.threads) if args.worker == "llama" else \
            worker_isolab(args.worker.split("-")[1], args.threads, gguf)
        print(json.dumps(res))
        return 0
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    rows = []
    for w in ("isolab-native", "isolab-dense", *(["llama"] if have_llama else [])):
        out = subprocess.run([sys.executable, __file__, "--worker", w, "--threads", str(args.threads),
                              *(["--model", args.model] if args.model else [])],
                             capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    result: dict = {"model": Path(gguf).name, "threads": args.threads, "new_tokens": NEW_TOKENS,
                    "machine": {"cpu": _cpu(), "platform": platform.platform()}, "engines": rows,
                    "llama_cpp_skipped": None if have_llama else "llama_cpp is not installed "
                    "(.venv/bin/pip install 'llama-cpp-python[server]==0.3.36' builds it in about 5 minutes)"}
    if not args.skip_servers:
        # (imported here: the llama.cpp worker and server import this file, and their RSS is measured)
        from isolab.testing.live_server import free_port

        port = free_port()
        servers = {"isolab serve": server_rss([str(Path(sys.executable).parent / "isolab"), "serve", "--no-auth",
                                                    "--port", str(port), "--model", gguf],
                                                   port, "/health")}
        if have_llama:
            port = free_port()
            bench_dir = str(Path(__file__).resolve().parent)
            servers["llama_cpp.server"] = server_rss(
                [sys.executable, "-c", LLAMA_SERVER.format(bench=bench_dir), "--model", gguf, "--port", str(port),
                 "--n_threads", str(args.threads)], port, "/v1/models")
        result["server_idle_rss_mib"] = {k: v and v[0] for k, v in servers.items()}
        result["server_rss_after_one_request_mib"] = {k: v and v[1] for k, v in servers.items()}
    if have_llama:
        iso, peer = rows[0], rows[-1]
        result["isolab_native_over_llama_cpp"] = {k: round(iso[k] / peer[k], 2) for k in
                                                  ("decode_short_tok_s", "decode_ctx1024_tok_s", "prefill_512_tok_s")}
    _print(result)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _cpu() -> str:
    from isolab.models.invariance import cpu_description

    return cpu_description()


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"single stream, {result['model']}, {result['threads']} threads, greedy, {NEW_TOKENS} new tokens")
    for col in ("engine", "decode tok/s (short)", "decode tok/s (ctx 1024)", "prefill 512 tok/s", "RSS idle MiB",
                "RSS peak MiB"):
        t.add_column(col)
    for r in result["engines"]:
        name = r["engine"] + (f" ({r['weights']})" if "weights" in r else "")
        t.add_row(name, str(r["decode_short_tok_s"]), str(r["decode_ctx1024_tok_s"]), str(r["prefill_512_tok_s"]),
                  str(r["rss_idle_mib"]), str(r["rss_peak_mib"]))
    Console().print(t)
    if "isolab_native_over_llama_cpp" in result:
        print("isolab native / llama.cpp:", result["isolab_native_over_llama_cpp"])
    if "server_idle_rss_mib" in result:
        print("server idle RSS (MiB):", result["server_idle_rss_mib"])
        print("server RSS after one request (MiB):", result["server_rss_after_one_request_mib"])
    if result["llama_cpp_skipped"]:
        print("llama.cpp skipped:", result["llama_cpp_skipped"])


if __name__ == "__main__":
    sys.exit(main())
