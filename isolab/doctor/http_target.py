"""Owns the doctor's target for any OpenAI-compatible server: `/v1/completions`, temperature as the
item asks, logprobs 5, over httpx.

Does not judge. Differences from the engine target: the server's cache outlives a run, so
cross-scope hits are judged against everything this doctor sent before; "alone" is one request in
flight (with the cache switch, when the user named one, to come closest to a fresh engine); the
comparison tolerates near-ties (a server need not be bit-exact); token strings stand for token ids.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import httpx

from isolab.base_url import check_base_url, failure, one_line
from isolab.doctor.symptoms import Result
from isolab.doctor.workload import Item, word_variant
from isolab.errors import InvalidRequestError


def parse_field(spec: str) -> dict:
    """'cache_prompt=false' -> {"cache_prompt": False}: the value is JSON when it parses, else a string."""
    key, eq, value = spec.partition("=")
    key = key.strip()
    if not eq or not key:
        raise InvalidRequestError(f"{spec!r}: write FIELD=VALUE, e.g. cache_prompt=false", field="no_cache_field")
    try:
        return {key: json.loads(value)}
    except ValueError:
        return {key: value}


TRANSPORT = "transport error: "  # a Result's error when the request got no HTTP answer at all


class HttpTarget:
    exact = False
    alone_label = "alone (one request at a time)"  # (the server's engine is shared: no fresh one per request)

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 scope_field: str | None = "cache_salt", no_cache: dict | None = None, stagger_s: float = 0.02,
                 timeout_s: float = 120.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        check_base_url(base_url)
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.scope_field = scope_field
        self.no_cache = no_cache
        self.can_disable_cache = no_cache is not None
        self.stagger_s = stagger_s
        self.timeout_s = timeout_s
        self.transport = transport
        self.history: list[tuple[Item, Result]] = []
        self.checked = False  # connect() has reached the server once
        self.name = f"OpenAI-compatible server at {self.base_url}"

    def numerics(self) -> tuple[str, bool] | None:
        """What the server's /health says of its numerics (isolab reports it; others: None)."""
        root = self.base_url[: -len("/v1")]

        async def go() -> tuple[str, bool] | None:
            async with httpx.AsyncClient(base_url=root, timeout=self.timeout_s, transport=self.transport) as c:
                try:
                    r = await c.get("/health")
                    body = r.json()
                except (httpx.HTTPError, ValueError):
                    return None
            if isinstance(body, dict) and isinstance(body.get("batch_invariant"), bool):
                return str(body.get("numerics", "unknown")), body["batch_invariant"]
            return None

        return asyncio.run(go())

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout_s, transport=self.transport)

    def connect(self) -> None:
        """Reach the server once before any work (as `isolab probe` does): an unreachable server, a
        refused key, or one that is not OpenAI-compatible is one sentence (InvalidRequestError)."""
        async def go() -> None:
            async with self._client() as client:
                await self._discover(client)

        asyncio.run(go())
        self.checked = True

    async def _discover(self, client: httpx.AsyncClient) -> None:
        """GET /models: the key is accepted, and the model is --model-name or the first one listed."""
        where = f"{self.base_url}/models"
        try:
            r = await client.get("/models")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise InvalidRequestError(f"cannot reach {self.base_url} ({failure(exc)})", field="base_url") from None
        if r.status_code in (401, 403):
            raise InvalidRequestError(f"{where} refused the key (HTTP {r.status_code}): pass the server's --api-key",
                                      field="api_key")
        if self.model is None:
            try:
                model = r.json()["data"][0]["id"] if r.status_code == 200 else None
            except (ValueError, KeyError, IndexError, TypeError):
                model = None
            if not isinstance(model, str) or not model:
                raise InvalidRequestError(f"{where} gave no model (HTTP {r.status_code}): is it an OpenAI-compatible "
                                          "server? If so, pass --model-name", field="base_url")
            self.model = model

    async def _model(self, client: httpx.AsyncClient) -> str:
        if self.model is None:
            await self._discover(client)
        assert self.model is not None
        return self.model

    async def _complete(self, client: httpx.AsyncClient, it: Item, cache: bool) -> Result:
        body: dict = {"model": await self._model(client), "prompt": it.prompt, "max_tokens": it.max_tokens,
                      "temperature": it.temperature, "logprobs": 5}
        if it.seed is not None:
            body["seed"] = it.seed
        if it.scope is not None and self.scope_field:
            body[self.scope_field] = it.scope
        if not cache and self.no_cache:
            body.update(self.no_cache)
        try:
            r = await client.post("/completions", json=body)
        except httpx.HTTPError as exc:
            return Result(it.item_id, (), (), (), "", 0, f"{TRANSPORT}{failure(exc)}")
        if r.status_code != 200:
            return Result(it.item_id, (), (), (), "", 0, f"HTTP {r.status_code}: {one_line(r.text[:200])}")
        try:
            data = r.json()
            ch = data["choices"][0]
            lp = ch.get("logprobs") or {}
            tokens = tuple(lp.get("tokens") or ()) or (ch["text"],)
            top = tuple(dict(t or {}) for t in (lp.get("top_logprobs") or ()))
            details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
            return Result(it.item_id, tokens, tuple(x for x in (lp.get("token_logprobs") or ()) if x is not None), top,
                          ch["text"], int(details.get("cached_tokens") or 0))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return Result(it.item_id, (), (), (), "", 0,
                          f"HTTP 200 but not an OpenAI completion: {one_line(r.text[:200])}")

    def prepare(self, items: Sequence[Item]) -> list[Item]:
        if not all(isinstance(it.prompt, str) for it in items):
            raise InvalidRequestError("a server workload needs text prompts", field="workload")
        if not self.checked:
            self.connect()
        return list(items)

    def variant(self, items: Sequence[Item], seed: int) -> list[Item]:
        return word_variant(items, seed)

    def alone(self, item: Item) -> Result:
        async def go() -> Result:
            async with self._client() as client:
                return await self._complete(client, item, cache=not self.can_disable_cache)

        res = asyncio.run(go())
        if not self.history and res.error is not None and res.error.startswith(TRANSPORT):
            # the first completion got no answer at all: the rest would wait as long each (--timeout)
            raise InvalidRequestError(f"{self.base_url}/completions gave no answer to the first request alone "
                                      f"({res.error.removeprefix(TRANSPORT)}; --timeout {self.timeout_s:g} s): "
                                      "is the server stuck, or slower than --timeout?", field="base_url")
        self.history.append((item, res))
        return res

    def together(self, items: Sequence[Item], concurrency: int, prefix_cache: bool) -> tuple[list[tuple[Item, Result]], dict]:
        async def go() -> list[Result]:
            sem = asyncio.Semaphore(concurrency)
            async with self._client() as client:
                await self._model(client)

                async def one(it: Item) -> Result:
                    try:
                        return await self._complete(client, it, prefix_cache)
                    finally:
                        sem.release()

                tasks = []
                for it in items:  # admitted in order, at most `concurrency` in flight
                    await sem.acquire()
                    tasks.append(asyncio.create_task(one(it)))
                    await asyncio.sleep(self.stagger_s)
                return list(await asyncio.gather(*tasks))

        results = asyncio.run(go())
        admitted = list(zip(items, results, strict=True))
        self.history.extend(admitted)
        return admitted, {"cached_tokens": sum(r.cached_tokens for r in results)}

    def cross_scope_history(self) -> list[tuple[Item, Result]]:
        return list(self.history)
