"""Tenants: keys -> tenant, server-derived cache scope, salt that only narrows. The live tests
carry their positive control: the same tenant *does* hit the shared 256-token prefix."""

from __future__ import annotations

import json

import pytest

from isolab.errors import InvalidRequestError
from isolab.server import TenantRegistry, load_registry
from isolab.server.tenants import Tenant, parse_keys_env, parse_keys_text

PREFIX = [40 + (i * 7) % 200 for i in range(256)]  # 256 tokens = 16 full blocks of 16


def _ask(client, model, tail: int, **extra):
    r = client.completions.create(model=model, prompt=PREFIX + [tail, tail + 1, tail + 2], max_tokens=1,
                                  temperature=0, extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


# -- unit ---------------------------------------------------------------------------------------------
def test_keys_file_formats_and_env():
    assert parse_keys_text("# comment\nk1 alice\n\nk2  bob # trailing\n", "f") == {"k1": "alice", "k2": "bob"}
    assert parse_keys_text(json.dumps({"k1": "alice"}), "f") == {"k1": "alice"}
    assert parse_keys_env("k1=alice, k2=bob") == {"k1": "alice", "k2": "bob"}
    with pytest.raises(InvalidRequestError):
        parse_keys_text("k1 alice extra\n", "f")
    with pytest.raises(InvalidRequestError):
        parse_keys_text("k1 alice\nk1 bob\n", "f")
    with pytest.raises(InvalidRequestError):
        parse_keys_env("k1")


def test_a_json_keys_file_refuses_a_key_given_twice_and_a_list():
    """json.loads kept the last of two equal keys: a key meant for alice served bob's cache."""
    with pytest.raises(InvalidRequestError, match="entry 2: this key is already given"):
        parse_keys_text('{"sk-dup": "alice", "sk-dup": "bob"}', "f")
    with pytest.raises(InvalidRequestError, match="is a JSON list"):
        parse_keys_text('["sk-a", "alice"]', "f")
    with pytest.raises(InvalidRequestError, match="must map key strings"):
        parse_keys_text('{"sk-a": {"tenant": "alice"}}', "f")


def test_registry_authenticates_and_refuses_empty(tmp_path):
    reg = load_registry(None, no_auth=False, environ={"ISOLAB_API_KEYS": "k1=alice,k2=bob"})
    assert reg.authenticate("k1") == Tenant("alice") and reg.authenticate("k2") == Tenant("bob")
    assert reg.authenticate("k3") is None and reg.authenticate("") is None and reg.authenticate(None) is None
    assert reg.authenticate("k1 ") is None and reg.authenticate("K1") is None
    f = tmp_path / "keys"
    f.write_text("k9 carol\n")
    both = load_registry(str(f), no_auth=False, environ={"ISOLAB_API_KEYS": "k1=alice"})
    assert both.tenant_ids == {"alice", "carol"}
    with pytest.raises(InvalidRequestError, match="no-auth"):
        load_registry(None, no_auth=False, environ={})
    anon = load_registry(None, no_auth=True, environ={})
    assert anon.authenticate(None) == anon.authenticate("anything") == Tenant("anonymous")
    with pytest.raises(InvalidRequestError):
        load_registry(None, no_auth=True, environ={"ISOLAB_API_KEYS": "k1=alice"})


def test_a_keys_file_from_a_windows_editor(tmp_path):
    """A UTF-8 BOM is not part of the first key (it got 401 while the second worked); UTF-16 text is
    one sentence, not a UnicodeDecodeError."""
    f = tmp_path / "keys"
    f.write_bytes("\ufeffk1 alice\nk2 bob\n".encode("utf-8"))
    reg = load_registry(str(f), no_auth=False, environ={})
    assert reg.authenticate("k1") == Tenant("alice") and reg.authenticate("k2") == Tenant("bob")
    f.write_bytes("k1 alice\n".encode("utf-16"))
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        load_registry(str(f), no_auth=False, environ={})


def test_tenant_ids_cannot_forge_a_salt_separator():
    with pytest.raises(InvalidRequestError):
        TenantRegistry({"k": "alice|salt:x"})
    with pytest.raises(InvalidRequestError):
        TenantRegistry({"k": "a b"})


def test_scope_is_derived_from_the_tenant_and_salt_only_narrows():
    a, b = Tenant("alice"), Tenant("bob")
    assert a.cache_scope() == "tenant:alice"
    assert a.cache_scope("s") == "tenant:alice|salt:s"
    assert a.cache_scope("s") != b.cache_scope("s")
    # a salt that spells another tenant's scope is still inside its own tenant
    assert b.cache_scope("x|tenant:alice") != a.cache_scope()
    assert b.cache_scope("x|tenant:alice").startswith("tenant:bob|")
    with pytest.raises(InvalidRequestError):
        a.cache_scope("")
    with pytest.raises(InvalidRequestError):
        a.cache_scope("s" * 1000)


# -- live ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle)


def test_tenants_do_not_share_and_the_same_tenant_does(srv):
    alice, bob, m = srv.client("sk-alice"), srv.client("sk-bob"), srv.model
    assert _ask(alice, m, 1) == 0  # cold
    assert _ask(bob, m, 4) == 0  # the prefix is cached, but for alice only
    assert _ask(alice, m, 7) == 256  # positive control: same tenant, shared prefix -> hit
    assert _ask(bob, m, 10) == 256  # bob's own first request warmed bob's scope
    # a client-sent scope or tenant field changes nothing (unknown fields are ignored)
    srv2_tail = 13
    assert _ask(bob, m, srv2_tail, cache_scope="tenant:alice", tenant="alice", user="alice") == 256


def test_salt_narrows_inside_a_tenant_and_never_crosses_tenants(srv):
    alice, bob, m = srv.client("sk-alice"), srv.client("sk-bob"), srv.model
    _ask(alice, m, 20)  # alice's unsalted scope holds the prefix
    assert _ask(alice, m, 23, cache_salt="s1") == 0  # salted: not the unsalted cache
    assert _ask(alice, m, 26, cache_salt="s1") == 256  # positive control: same salt -> hit
    assert _ask(bob, m, 29, cache_salt="s1") == 0  # same salt, other tenant -> miss
    assert _ask(alice, m, 32, cache_salt="s2") == 0


def test_no_auth_serves_one_anonymous_tenant(server_factory, tiny_bundle):
    srv = server_factory(tiny_bundle, tenants=TenantRegistry({}, anonymous=True))
    anyone, other = srv.client("whatever"), srv.client("something-else")
    assert _ask(anyone, srv.model, 1) == 0
    assert _ask(other, srv.model, 4) == 256  # one tenant: everyone shares
