"""Fixtures for the server suite: a real uvicorn on 127.0.0.1 (a free port, a background thread)
around an in-process engine that shares the session's model bundle, and OpenAI clients for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from isolab.config import CacheConfig, EngineConfig, MiB, SchedulerConfig
from isolab.engine.llm_engine import LLMEngine
from isolab.server import ServerConfig, TenantRegistry, create_app
from isolab.testing.live_server import serve_in_thread

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    engine: LLMEngine
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def model(self) -> str:
        return self.models()[0]

    def models(self) -> list[str]:
        r = httpx.get(self.base_url + "/models", headers={"Authorization": "Bearer sk-alice"})
        return [m["id"] for m in r.json()["data"]]

    def client(self, key: str = "sk-alice", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, **kw)

    def async_client(self, key: str = "sk-alice", **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, **kw)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples as {'name{labels}': value}."""
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine has nothing in flight (polled through its thread's stats snapshot)."""
        loop = self.app.state.engine_loop
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = loop.stats
            if s["running"] == 0 and s["waiting"] == 0 and loop.num_pending_commands == 0 and loop.num_reserved == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"the engine did not go idle: {loop.stats}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(bundle: Any, *, server_config: ServerConfig | None = None, tenants: TenantRegistry | None = None,
                 kv_cache_memory: int = 64 * MiB, max_num_seqs: int = 64, max_model_len: int | None = None,
                 block_size: int = 16, kv_cache_dtype: str = "auto") -> LiveServer:
    engine = LLMEngine(
        EngineConfig(cache=CacheConfig(block_size, kv_cache_memory, True, kv_cache_dtype=kv_cache_dtype),
                     scheduler=SchedulerConfig(max_num_seqs, 512), max_model_len=max_model_len, device="cpu"),
        bundle=bundle,
    )
    app = create_app(engine, tenants or TenantRegistry(KEYS), server_config or ServerConfig())
    url, server, thread = serve_in_thread(app)
    return LiveServer(url, engine, app, server, thread)


@pytest.fixture(scope="module")
def server_factory() -> Iterator[Callable[..., LiveServer]]:
    """start_server(...) for this module; every server is stopped when the module ends."""
    started: list[LiveServer] = []

    def make(bundle: Any, **kw: Any) -> LiveServer:
        s = start_server(bundle, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
