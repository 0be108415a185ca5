"""Owns ServerState: what one app holds (engine loop, tenants, config, metrics, serving), typed.

create_app builds it and puts it where Starlette keeps `app.state`; the server's code reads it
through server_state(app) (the gate gets it directly). `app.state.draining` and
`app.state.engine_loop` keep working for callers outside the package (isolab serve's signal
handler, the tests). Does not know routes or the reply formats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.applications import Starlette

from isolab.models.invariance import InvarianceReport
from isolab.server.backend import EngineBackend
from isolab.server.metrics import ServerMetrics
from isolab.server.serving import Serving
from isolab.server.settings import ServerConfig
from isolab.server.tenants import TenantRegistry
from isolab.server.tokenize import Tokenization


@dataclass
class ServerState:
    # Not frozen: `draining` flips once, on the first SIGTERM (isolab.commands.serve sets it).
    config: ServerConfig
    tenants: TenantRegistry
    engine_loop: EngineBackend  # one engine (EngineLoop) or replicas (scaleout.ReplicaSet)
    metrics: ServerMetrics
    serving: Serving
    tokenization: Tokenization  # /tokenize and /detokenize
    model_name: str  # the served id: model_names[0]
    model_names: tuple[str, ...]  # the id, then its aliases (--served-model-name NAME [ALIAS ...])
    capacity: int  # engine requests admitted at once: running slots + queue
    numerics: InvarianceReport  # measured once at start (models/invariance.py); read-only after
    kv_cache_dtype: str = "auto"  # what the engines' K/V pools store
    started: float = field(default_factory=time.time)
    draining: bool = False


def server_state(app: Starlette) -> ServerState:
    state = app.state
    if not isinstance(state, ServerState):
        raise TypeError("this app was not built by isolab.server.create_app")
    return state
