"""Owns who a caller is: API keys -> tenants, and the cache scope the server derives from a tenant.

The cache scope is never taken from the client: it is `tenant:<id>` for the authenticated tenant,
and a request's optional `cache_salt` can only narrow it (`tenant:<id>|salt:<salt>`), so two
tenants never share a prefix block whatever they send. Tenant ids are restricted to
[A-Za-z0-9_.-] so that the `|salt:` separator cannot be forged from inside a tenant id.

Key sources (merged; a key may appear once):
  * a file: JSON `{"key": "tenant", ...}`, or lines `KEY TENANT` (`#` starts a comment);
  * the environment variable ISOLAB_API_KEYS: `key1=tenantA,key2=tenantB`.
Keys are compared in constant time (hmac.compare_digest over SHA-256 digests, every key tried).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from isolab.errors import InvalidRequestError

ENV_VAR = "ISOLAB_API_KEYS"
ANONYMOUS = "anonymous"
MAX_SALT_CHARS = 256
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Tenant:
    tenant_id: str

    def cache_scope(self, cache_salt: str | None = None) -> str:
        """The prefix-cache scope for this tenant; a salt narrows sharing inside the tenant only."""
        scope = f"tenant:{self.tenant_id}"
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_SALT_CHARS:
                raise InvalidRequestError(
                    f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters",
                    field="cache_salt",
                )
            scope += f"|salt:{cache_salt}"
        return scope


def scope_owner(scope: str) -> str:
    """The tenant part of a cache scope (`tenant:<id>`, without `|salt:...`): tenant ids never hold '|'."""
    return scope.split("|", 1)[0]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class TenantRegistry:
    """authenticate(key) -> Tenant | None. With `anonymous=True` (the --no-auth mode) every caller
    is the single anonymous tenant and keys are ignored."""

    def __init__(self, keys: dict[str, str], *, anonymous: bool = False) -> None:
        if not keys and not anonymous:
            raise InvalidRequestError(
                f"no API keys configured: give --api-keys FILE or set {ENV_VAR}, or pass --no-auth to serve "
                "one anonymous tenant",
                field="api_keys",
            )
        for key, tenant in keys.items():
            if not key or any(c.isspace() for c in key):
                raise InvalidRequestError("an API key is empty or holds whitespace", field="api_keys")
            if not _TENANT_RE.match(tenant):
                raise InvalidRequestError(
                    f"tenant id {tenant!r} must be 1-64 characters of letters, digits, '_', '.', '-'",
                    field="api_keys",
                )
        self.anonymous = anonymous
        self._entries: tuple[tuple[bytes, Tenant], ...] = tuple((_digest(k), Tenant(t)) for k, t in keys.items())

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    @property
    def tenant_ids(self) -> frozenset[str]:
        return frozenset(t.tenant_id for _, t in self._entries)

    def authenticate(self, key: str | None) -> Tenant | None:
        if self.anonymous:
            return Tenant(ANONYMOUS)
        if not key:
            return None
        probe = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._entries:  # no early exit: the time does not depend on which key
            if hmac.compare_digest(probe, digest):
                found = tenant
        return found


def parse_keys_text(text: str, source: str) -> dict[str, str]:
    """A keys file's text -> {key: tenant}. JSON object, or `KEY TENANT` lines."""
    stripped = text.strip()
    if stripped.startswith("["):  # (it was read as lines: "tenant id '"alice"]' must be ...")
        raise InvalidRequestError(f"{source} is a JSON list: give a JSON object {{\"KEY\": \"TENANT\", ...}} or "
                                  "'KEY TENANT' lines", field="api_keys")
    if stripped.startswith("{"):
        try:
            pairs = json.loads(stripped, object_pairs_hook=list)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{source} is not valid JSON ({exc.msg}, line {exc.lineno})", field="api_keys") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
            raise InvalidRequestError(f"{source} must map key strings to tenant strings", field="api_keys")
        data: dict[str, str] = {}
        for i, (key, tenant) in enumerate(pairs, 1):  # (json.loads kept the last of two equal keys, silently)
            _add(data, key, tenant, f"{source} entry {i}")
        return data
    keys: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InvalidRequestError(f"{source} line {lineno}: expected 'KEY TENANT'", field="api_keys")
        _add(keys, parts[0], parts[1], f"{source} line {lineno}")
    return keys


def parse_keys_env(value: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for i, item in enumerate(x for x in value.split(",") if x.strip()):
        key, sep, tenant = item.strip().partition("=")
        if not sep:
            raise InvalidRequestError(f"{ENV_VAR} entry {i + 1}: expected 'key=tenant'", field="api_keys")
        _add(keys, key.strip(), tenant.strip(), f"{ENV_VAR} entry {i + 1}")
    return keys


def _add(keys: dict[str, str], key: str, tenant: str, where: str) -> None:
    if key in keys:
        raise InvalidRequestError(f"{where}: this key is already given", field="api_keys")
    keys[key] = tenant


def load_registry(path: str | None, *, no_auth: bool, environ: dict[str, str] | None = None) -> TenantRegistry:
    """Keys from the file and the environment; refuses an empty set unless no_auth."""
    env = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the first key
        except OSError as exc:
            raise InvalidRequestError(f"cannot read the API keys file {path!r} ({exc.strerror})", field="api_keys") from None
        except UnicodeDecodeError:
            raise InvalidRequestError(f"the API keys file {path!r} is not UTF-8 text (save it as UTF-8)",
                                      field="api_keys") from None
        keys.update(parse_keys_text(text, repr(path)))
    if env.get(ENV_VAR):
        for key, tenant in parse_keys_env(env[ENV_VAR]).items():
            _add(keys, key, tenant, ENV_VAR)
    if no_auth and keys:
        raise InvalidRequestError("--no-auth was given together with API keys: choose one", field="api_keys")
    return TenantRegistry(keys, anonymous=no_auth)
