"""Owns the probe's side of HTTP: /v1/completions requests (plain or streamed) -> Completion records.

Speaks to any OpenAI-compatible server with httpx. What a server lacks is learnt, not assumed:
a 4xx that names an extension field (logprobs, cache_salt, ignore_eos, seed) drops that field for
the rest of the run, and the scenarios that needed it say INCONCLUSIVE with the reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from isolab.base_url import failure, one_line
from isolab.probe.record import Completion


class ProbeUsageError(Exception):
    """The probe cannot run: bad arguments or an unreachable server. One sentence, exit code 2."""


@dataclass
class Capabilities:
    logprobs: bool = True  # the server answers `logprobs: k` on /v1/completions
    ignore_eos: bool = True  # the server takes the `ignore_eos` extension
    cache_salt: bool = True  # the server takes the `cache_salt` field (whether it honours it is a scenario)
    seed: bool = True
    stream_options: bool = True  # the server takes `stream_options: {include_usage: true}` on streams
    dropped: list[str] = field(default_factory=list)  # "field: the server's reason"


@dataclass(frozen=True)
class Identity:
    """Who sends a request: an API key and/or a cache_salt, under a short label for the report."""

    label: str
    api_key: str | None = None
    cache_salt: str | None = None


class ProbeClient:
    def __init__(self, base_url: str, *, model: str | None = None, timeout_s: float = 120.0,
                 top_logprobs: int = 5, transport: httpx.AsyncBaseTransport | None = None) -> None:
        base = base_url.rstrip("/")
        self.base_v1 = base if base.endswith("/v1") else base + "/v1"
        self.root = self.base_v1[: -len("/v1")]
        self.model = model
        self.top_logprobs = top_logprobs
        self.caps = Capabilities()
        self.t0 = time.monotonic()
        self.num_requests = 0
        self.http = httpx.AsyncClient(timeout=timeout_s, transport=transport,
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    async def close(self) -> None:
        await self.http.aclose()

    def _headers(self, who: Identity) -> dict[str, str]:
        return {"Authorization": f"Bearer {who.api_key}"} if who.api_key else {}

    async def discover(self, who: Identity) -> str:
        """The model to probe: --model, or the first one /v1/models lists."""
        try:
            r = await self.http.get(self.base_v1 + "/models", headers=self._headers(who))
        except httpx.HTTPError as exc:
            raise ProbeUsageError(f"cannot reach {self.base_v1} ({failure(exc)})") from None
        if r.status_code in (401, 403):
            raise ProbeUsageError(f"{self.base_v1}/models refused the key (HTTP {r.status_code}): pass --api-key")
        if self.model is None:
            try:
                self.model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ProbeUsageError(f"{self.base_v1}/models gave no model (HTTP {r.status_code}): pass --model") from None
        return self.model

    async def get_raw(self, path: str) -> tuple[int, str]:
        """An unauthenticated GET on the server root (for the monitoring scenario)."""
        try:
            r = await self.http.get(self.root + path)
        except httpx.HTTPError as exc:
            return 0, f"({type(exc).__name__})"
        return r.status_code, r.text[:1_000_000]

    def _body(self, prompt: str, who: Identity, max_tokens: int, temperature: float, seed: int | None,
              stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        if self.model:
            body["model"] = self.model
        if self.caps.logprobs:
            body["logprobs"] = self.top_logprobs
        if self.caps.ignore_eos:
            body["ignore_eos"] = True  # fixed-length outputs compare position by position
        if seed is not None and self.caps.seed:
            body["seed"] = seed
        if who.cache_salt is not None and self.caps.cache_salt:
            body["cache_salt"] = who.cache_salt
        if stream:
            body["stream"] = True
            if self.caps.stream_options:
                body["stream_options"] = {"include_usage": True}
        return body

    def _drop_rejected_field(self, status: int, text: str, body: dict[str, Any]) -> bool:
        """After a 4xx: if the error names an extension field we sent, stop sending it. True to retry."""
        if status not in (400, 422):
            return False
        low = text.lower()
        for name in ("logprobs", "ignore_eos", "cache_salt", "seed", "stream_options"):
            if name in body and name in low and getattr(self.caps, name):
                setattr(self.caps, name, False)
                self.caps.dropped.append(f"{name}: {text[:160]}")
                return True
        return False

    async def complete(self, prompt: str, who: Identity, *, max_tokens: int = 16, temperature: float = 0.0,
                       seed: int | None = None, stream: bool = False, tags: tuple[str, ...] = (),
                       on_progress: Callable[[int], None] | None = None) -> Completion:
        """One completion; `on_progress(n)` (streams only) is called with the number of tokens so far."""
        for _ in range(5):  # at most one retry per dropped field
            body = self._body(prompt, who, max_tokens, temperature, seed, stream)
            rec = Completion(prompt, tenant=who.label, seed=seed, temperature=temperature, tags=list(tags))
            start = time.monotonic()
            rec.sent_at = start - self.t0
            self.num_requests += 1
            try:
                if stream:
                    status, text = await self._stream(body, who, rec, start, on_progress)
                else:
                    r = await self.http.post(self.base_v1 + "/completions", json=body, headers=self._headers(who))
                    status, text = r.status_code, r.text
                    if status == 200:
                        _fill(rec, r.json())
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                rec.status, rec.error = 0, failure(exc)
                return rec
            rec.latency_s = time.monotonic() - start
            if status == 200:
                return rec
            if self._drop_rejected_field(status, text, body):
                continue
            rec.status, rec.error = status, one_line(text[:300])  # (an HTML page's lines, on one)
            return rec
        return rec

    async def _stream(self, body: dict[str, Any], who: Identity, rec: Completion, start: float,
                      on_progress: Callable[[int], None] | None) -> tuple[int, str]:
        parts: list[dict[str, Any]] = []
        num_tokens = 0
        async with self.http.stream("POST", self.base_v1 + "/completions", json=body, headers=self._headers(who)) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode("utf-8", "replace")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if not isinstance(chunk, dict) or not isinstance(chunk.get("choices") or [], list) or not all(
                        isinstance(c, dict) and isinstance(c.get("logprobs") or {}, dict) for c in chunk.get("choices") or []):
                    raise _shape_error("a stream event without a list of choice objects", chunk)
                text = chunk["choices"][0].get("text") if chunk.get("choices") else None
                if text and rec.ttft_s is None:
                    rec.ttft_s = time.monotonic() - start
                parts.append(chunk)
                if text and on_progress is not None:
                    lp = chunk["choices"][0].get("logprobs") or {}
                    num_tokens += len(lp.get("tokens") or ()) or len(text)
                    on_progress(num_tokens)
        merged: dict[str, Any] = {"choices": [{"text": "", "logprobs": None, "finish_reason": None}]}
        choice = merged["choices"][0]
        for chunk in parts:
            if chunk.get("usage"):
                merged["usage"] = chunk["usage"]
            for ch in chunk.get("choices") or []:
                if ch.get("index", 0) != 0:
                    continue
                choice["text"] += ch.get("text") or ""
                choice["finish_reason"] = ch.get("finish_reason") or choice["finish_reason"]
                lp = ch.get("logprobs")
                if lp:
                    acc = choice["logprobs"] = choice["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
                    for k in acc:
                        acc[k].extend(lp.get(k) or [])
        _fill(rec, merged)
        return 200, ""


def _shape_error(what: str, value: Any) -> ValueError:
    return ValueError(f"HTTP 200 but not an OpenAI completion ({what}: {one_line(json.dumps(value)[:120])})")


def _fill(rec: Completion, data: dict[str, Any]) -> None:
    """Copy a completions reply (OpenAI's legacy logprobs format) into the record; ValueError (a
    sentence) for a reply of another shape (it was an IndexError's traceback)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _shape_error("no choices[0] object", data)
    choice = choices[0]
    for key, value in (("choices[0].logprobs", choice.get("logprobs")), ("usage", data.get("usage")),
                       ("usage.prompt_tokens_details", (data.get("usage") or {}).get("prompt_tokens_details")
                        if isinstance(data.get("usage"), dict) else None)):
        if value is not None and not isinstance(value, dict):
            raise _shape_error(f"{key} is not an object", value)
    rec.text = choice.get("text") or ""
    rec.finish_reason = choice.get("finish_reason")
    lp = choice.get("logprobs")
    if lp and lp.get("tokens") is not None:
        rec.tokens = list(lp["tokens"])
        rec.token_logprobs = list(lp.get("token_logprobs") or [])
        tops = lp.get("top_logprobs")
        rec.top_logprobs = [dict(t or {}) for t in tops] if tops is not None else None
    usage = data.get("usage") or {}
    rec.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    rec.cached_tokens = int(cached) if isinstance(cached, int | float) else None
