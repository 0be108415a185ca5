"""Fixtures for the probe suite: an isolab server (uvicorn on 127.0.0.1, a free port, a thread)
around an engine with chosen faults, on the tiny model unless a test asks for the real one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from isolab.config import CacheConfig, EngineConfig, MiB, SchedulerConfig
from isolab.engine.llm_engine import LLMEngine
from isolab.server import ServerConfig, TenantRegistry, create_app
from isolab.testing.live_server import serve_in_thread

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


@contextmanager
def isolab_server(bundle, *, faults: tuple[str, ...] = (), kv_cache_memory: int = 64 * MiB,
                  keys: dict[str, str] | None = KEYS, wrap: Callable[[Any], Any] | None = None) -> Iterator[str]:
    """Yields the server's base URL (http://127.0.0.1:PORT); stops it on exit. `wrap` wraps the ASGI app."""
    engine = LLMEngine(EngineConfig(cache=CacheConfig(16, kv_cache_memory, True), scheduler=SchedulerConfig(64, 512),
                                    device="cpu", inject_faults=frozenset(faults)), bundle=bundle)
    tenants = TenantRegistry(keys) if keys else TenantRegistry({}, anonymous=True)
    app = create_app(engine, tenants, ServerConfig())
    url, server, thread = serve_in_thread(wrap(app) if wrap else app, lifespan="on")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()


