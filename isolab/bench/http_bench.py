"""Owns the HTTP side of `isolab bench --url`: a streamed-completions load against any
OpenAI-compatible server, measuring what its clients feel.

    run_http_bench(url, api_key, model, prompts, max_tokens, concurrency) -> dict

Per request: time to first token (TTFT: request sent -> first non-empty text chunk), inter-token
latencies (gaps between text chunks), end-to-end time, output tokens (the server's usage when it
sends one with stream_options.include_usage, else the number of text chunks). In aggregate: output
tokens per second over the wall time of the whole run, and p50/p90/p99 of each latency.
Does not start servers and does not know the workload's origin.

The client is aiohttp (its HTTP parser is C): on a 2-core machine the clients share the cores with
the server, and every millisecond they spend parsing is taken from the engine. The result says
what the clients cost (`client_cpu_s`, `client_cpu_us_per_chunk`: this process's CPU time over the
run): 39-51 us a chunk with aiohttp in bench/results/issue14_http*_s26_r*.json; the httpx client
it replaced took 125-129 us, measured once the same way (docs/engine.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import aiohttp.http_exceptions

from isolab.errors import IsolabError


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.num_chunks


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation between closest ranks); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99)}


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _one(session: aiohttp.ClientSession, base: str, headers: dict[str, str], body: dict[str, Any]) -> RequestResult:
    res = RequestResult(ok=False)
    start = time.perf_counter()
    last: float | None = None
    try:
        async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                text = (await r.read()).decode("utf-8", "replace")
                res.error = f"HTTP {r.status}: {text[:200]}"
                return res
            done = False
            async for raw in r.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    res.error = f"an event that is not a JSON object: {data[:100]!r}"
                    return res
                if obj.get("error"):
                    res.error = str(obj["error"])[:200]
                    return res
                usage, choices = obj.get("usage"), obj.get("choices") or []
                if (usage is not None and not isinstance(usage, dict)) or not isinstance(choices, list) or not all(
                        isinstance(c, dict) for c in choices):
                    res.error = f"an event that is not an OpenAI completion chunk: {data[:100]!r}"
                    return res
                if usage and usage.get("completion_tokens") is not None:
                    res.usage_tokens = int(usage["completion_tokens"])
                for choice in choices:
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.num_chunks += 1
            if not done:  # an HTML page, a plain JSON reply, a stream cut short: not a completed stream
                res.error = "HTTP 200 but no stream ending in data: [DONE] (not an OpenAI-compatible stream)"
                return res
        res.ok = True
    except (TimeoutError, aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, ValueError, TypeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        res.e2e_s = time.perf_counter() - start
    return res


async def _served_model(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    """The first model the server lists; IsolabError (one sentence) when it cannot say."""
    try:
        async with session.get(base + "/v1/models", headers=headers) as r:
            if r.status != 200:
                text = " ".join((await r.read()).decode("utf-8", "replace").split())  # one line, however it came
                if text.lstrip().lower().startswith(("<!doctype", "<html")):
                    text = "an HTML page: not an OpenAI-compatible server?"
                raise IsolabError(f"{base}/v1/models answered HTTP {r.status}: {text[:160]}")
            return str((await r.json(content_type=None))["data"][0]["id"])
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise IsolabError(f"cannot reach {base} ({type(exc).__name__}: {exc})") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise IsolabError(f"{base}/v1/models did not list a model; pass --served-model") from None


async def _run(url: str, api_key: str | None, model: str | None, prompts: list[str], max_tokens: list[int],
               concurrency: int, *, ignore_eos: bool, timeout_s: float, temperature: float,
               extra_body: dict[str, Any] | None, keepalive: bool) -> dict[str, Any]:
    base = _base(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # keepalive=False: a connection a request (TTFT then includes the connect), for a server that
    # drops requests sent on reused connections (bench/server_compare.py's llama-server)
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=not keepalive)
    # timeout_s bounds a connect and each wait for data, not a whole stream (as httpx's did); lines
    # (one SSE event each) up to 2 x read_bufsize = 8 MiB, room for any logprobs a request asks for
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=1 << 22) as client:
        if model is None:
            model = await _served_model(client, base, headers)
        gate = asyncio.Semaphore(concurrency)

        async def gated(prompt: str, n: int) -> RequestResult:
            body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": temperature,
                                    "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                body["ignore_eos"] = True  # vLLM's extension; servers without it ignore the field
            body.update(extra_body or {})
            async with gate:
                return await _one(client, base, headers, body)

        wall_start = time.perf_counter()
        results = await asyncio.gather(*(gated(p, n) for p, n in zip(prompts, max_tokens, strict=True)))
        wall_s = time.perf_counter() - wall_start
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "url": base,
        "model": model,
        "num_requests": len(results),
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "tokens_counted_from": "usage" if done and all(r.usage_tokens is not None for r in done) else "chunks",
        "ttft_s": percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in done for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in done]),
        "tokens_per_request": percentiles([float(r.output_tokens) for r in done]),
        "_chunks": sum(r.num_chunks for r in results),
    }


def run_http_bench(url: str, api_key: str | None, model: str | None, prompts: list[str], max_tokens: list[int],
                   concurrency: int, *, ignore_eos: bool = True, timeout_s: float = 600.0,
                   temperature: float = 0.0, extra_body: dict[str, Any] | None = None,
                   keepalive: bool = True) -> dict[str, Any]:
    """Send every prompt as a streamed completion, at most `concurrency` at a time; see the module doc.
    `extra_body` is merged into every request (e.g. a logit_bias against end-of-sequence for a server
    without `ignore_eos`). keepalive=False opens a connection a request."""
    if len(prompts) != len(max_tokens):
        raise ValueError("give one max_tokens per prompt")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    cpu = time.process_time()
    out = asyncio.run(_run(url, api_key, model, prompts, max_tokens, concurrency, ignore_eos=ignore_eos,
                           timeout_s=timeout_s, temperature=temperature, extra_body=extra_body,
                           keepalive=keepalive))
    cpu = time.process_time() - cpu
    chunks = out.pop("_chunks")
    out["client_cpu_s"] = cpu
    out["client_cpu_us_per_chunk"] = cpu / chunks * 1e6 if chunks else None
    out["keepalive"] = keepalive
    return out
