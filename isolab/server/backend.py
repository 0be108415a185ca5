"""Owns the boundary between the HTTP layer and whatever runs the model: one engine or many.

    EngineBackend: what Serving, the app and the metrics call (server/engine_loop.EngineLoop runs one
                   engine in a thread; scaleout/replica_set.ReplicaSet routes over Ray Serve replicas)
    ModelFacts:    what the HTTP layer needs of the model (tokenizer, limits, numerics), not its weights

Only the asyncio side calls submit/abort/try_reserve/release; `stats` is a snapshot to read, never
engine internals. Does not know HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from isolab.engine.grammar import GrammarCompiler
from isolab.engine.llm_engine import RequestOutput
from isolab.models.invariance import InvarianceReport
from isolab.models.tokenizer import Tokenizer
from isolab.server.engine_loop import EngineRequest


class EngineBackend(Protocol):
    peak_reserved: int  # high-water mark of the admission bound (tests and metrics)

    @property
    def alive(self) -> bool: ...
    @property
    def stats(self) -> dict[str, float]: ...  # running, waiting, kv_blocks_*, prefix_cache_*, ...
    @property
    def num_pending_commands(self) -> int: ...
    @property
    def num_pending_requests(self) -> int: ...  # submitted, not yet taken by the engine (aborts not counted)
    @property
    def num_reserved(self) -> int: ...

    def start(self) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def try_reserve(self, n: int, capacity: int) -> bool: ...
    def release(self, n: int) -> None: ...
    async def submit(self, requests: Sequence[EngineRequest], cache_scope: str) -> asyncio.Queue[RequestOutput]: ...
    def abort(self, request_ids: Sequence[str]) -> None: ...
    def describe(self) -> dict[str, Any]: ...  # extra /health fields (counts and states only)
    def register_metrics(self, registry: CollectorRegistry) -> None: ...


@dataclass(frozen=True)
class ModelFacts:
    tokenizer: Tokenizer
    default_names: tuple[str, ...]  # the served ids when --served-model-name is not given
    max_model_len: int  # the most tokens (prompt + new) a request may hold: the context, or the KV pool if smaller
    max_num_seqs: int  # per engine
    num_engines: int  # the admission bound is num_engines * (max_num_seqs + max_queue)
    grammars: GrammarCompiler  # compiled grammars are shared read-only (validation at the door)
    numerics: InvarianceReport  # measured once at start (models/invariance.py)
    kv_cache_dtype: str = "auto"  # what the engines' K/V pools store (config.CacheConfig)
