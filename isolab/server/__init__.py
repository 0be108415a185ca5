"""Owns the OpenAI-compatible HTTP server: `create_app(engine, tenants, config)` and its parts.

The names below load on first use, so a module that needs only the request schema
(isolab.server.protocol: LLM.chat reads messages with it) does not import the app, FastAPI and
uvicorn with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isolab.server.app import create_app
    from isolab.server.settings import ServerConfig
    from isolab.server.tenants import Tenant, TenantRegistry, load_registry

__all__ = ["ServerConfig", "Tenant", "TenantRegistry", "create_app", "load_registry"]
_HOME = {"create_app": "app", "ServerConfig": "settings", "Tenant": "tenants", "TenantRegistry": "tenants",
         "load_registry": "tenants"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"isolab.server.{_HOME[name]}"), name)
    raise AttributeError(f"module 'isolab.server' has no attribute {name!r}")
