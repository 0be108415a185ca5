"""Owns the OpenAI-compatible HTTP server: `create_app(engine, tenants, config)` and its parts."""

from isolab.server.app import create_app
from isolab.server.settings import ServerConfig
from isolab.server.tenants import Tenant, TenantRegistry, load_registry

__all__ = ["ServerConfig", "Tenant", "TenantRegistry", "create_app", "load_registry"]
