"""The routing decision (scaleout/router.py), with no Ray: affinity, balance, failover, forgetting, and
the isolation property: a scope's decisions never depend on another scope's history."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolab.errors import InvalidRequestError
from isolab.scaleout.router import Router, RoutingConfig, prefix_hashes

BS = 16


def prompt(seed: int, blocks: int = 4, tail: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(blocks * BS + tail)]


def test_a_repeated_prefix_goes_where_it_went():
    r = Router(2, RoutingConfig(block_size=BS))
    first = r.route("t:a", prompt(1), [0, 0], [True, True])
    assert first.kind == "new"
    for i in range(5):
        again = r.route("t:a", prompt(1)[: 4 * BS] + [7, 8, i], [0, 0], [True, True])
        assert (again.replica, again.kind) == (first.replica, "affinity")


def test_the_longest_known_prefix_decides():
    r = Router(3, RoutingConfig(block_size=BS))
    base = prompt(2, blocks=2, tail=0)
    a = r.route("s", base + prompt(3, blocks=2, tail=0), [0, 0, 0], [True] * 3)
    # another request shares only the first two blocks, sent while a's replica is busier
    loads = [0, 0, 0]
    loads[a.replica] = 1
    b = r.route("s", base + prompt(4, blocks=2, tail=0), loads, [True] * 3)
    assert (b.replica, b.kind) == (a.replica, "affinity")  # 1 request more is not hot


def test_a_hot_replica_sheds_to_the_least_loaded():
    r = Router(2, RoutingConfig(block_size=BS, balance_abs=4, balance_rel=1.5))
    home = r.route("s", prompt(5), [0, 0], [True, True]).replica
    loads = [0, 0]
    loads[home] = 6
    d = r.route("s", prompt(5), loads, [True, True])
    assert (d.replica, d.kind) == (1 - home, "balance")
    # the prefix now lives where it went: the next repeat follows it
    assert r.route("s", prompt(5), [0, 0], [True, True]).replica == 1 - home


def test_a_down_replica_is_routed_around_and_forgotten_after_restart():
    r = Router(2, RoutingConfig(block_size=BS))
    home = r.route("s", prompt(6), [0, 0], [True, True]).replica
    up = [True, True]
    up[home] = False
    d = r.route("s", prompt(6), [0, 0], up)
    assert (d.replica, d.kind) == (1 - home, "failover")
    assert r.route("s", prompt(7), [0, 0], [False, False]) is None  # nobody up: the caller says 503
    r.forget_replica(1 - home)
    assert r.route("s", prompt(6), [0, 0], [True, True]).kind == "new"


def test_short_prompts_and_new_prefixes_spread_by_hash():
    r = Router(2, RoutingConfig(block_size=BS))
    seen = {r.route("s", prompt(100 + i), [0, 0], [True, True]).replica for i in range(32)}
    assert seen == {0, 1}
    assert r.route("s", [1, 2, 3], [0, 0], [True, True]).kind == "new"  # no full block: nothing to remember
    assert r.num_entries("s") == 32 * 4


def test_tables_are_bounded_per_tenant():
    r = Router(2, RoutingConfig(block_size=BS, max_entries_per_scope=10, max_scopes_per_owner=3))
    for i in range(20):
        r.route("t:a", prompt(i), [0, 0], [True, True], owner="t:a")
    assert r.num_entries("t:a", owner="t:a") == 10
    for salt in ("x", "y", "z"):
        r.route(f"t:a|salt:{salt}", prompt(1), [0, 0], [True, True], owner="t:a")
    assert r.num_entries("t:a", owner="t:a") == 0  # the tenant's least recent scope went
    assert r.num_entries("t:a|salt:z", owner="t:a") == 4


def test_a_tenant_flooding_salts_never_evicts_another_tenants_table():
    """Tenant a sends 2,000 cache_salt values (scopes); tenant b's prefix still routes by affinity."""
    r = Router(2, RoutingConfig(block_size=BS, max_scopes_per_owner=16))
    home = r.route("t:b", prompt(1), [0, 0], [True, True], owner="t:b").replica
    for i in range(2000):
        r.route(f"t:a|salt:{i}", prompt(2), [0, 0], [True, True], owner="t:a")
    again = r.route("t:b", prompt(1), [0, 0], [True, True], owner="t:b")
    assert (again.replica, again.kind) == (home, "affinity")
    assert r.num_entries("t:b", owner="t:b") == 4


def test_policies_and_bad_config():
    with pytest.raises(InvalidRequestError, match="routing must be one of"):
        RoutingConfig(policy="sticky")
    r = Router(2, RoutingConfig(policy="least-loaded", block_size=BS))
    assert r.route("s", prompt(1), [3, 1], [True, True]).replica == 1
    r = Router(2, RoutingConfig(policy="random", block_size=BS, seed=3))
    assert {r.route("s", prompt(1), [0, 0], [True, True]).replica for _ in range(40)} == {0, 1}


def test_hashes_start_from_the_scope():
    p = prompt(9)
    assert prefix_hashes("a", p, BS, 32) != prefix_hashes("b", p, BS, 32)
    assert len(prefix_hashes("a", p, BS, 2)) == 2 and prefix_hashes("a", p[:BS - 1], BS, 32) == []


def repeat_hit_rate(policy: str, num_prefixes: int = 64, seed: int = 0) -> float:
    """Each prefix sent twice (the repeat after every first): the share of repeats that reach the
    replica that computed the prefix (the one holding it in its cache)."""
    r = Router(2, RoutingConfig(policy=policy, block_size=BS, seed=seed))
    home, hits = {}, 0
    for i in range(num_prefixes):
        home[i] = r.route("s", prompt(i), [0, 0], [True, True]).replica
    for i in range(num_prefixes):
        hits += r.route("s", prompt(i), [0, 0], [True, True]).replica == home[i]
    return hits / num_prefixes


def test_affinity_reaches_the_cache_where_random_routing_is_a_coin_flip():
    assert repeat_hit_rate("affinity") == 1.0
    assert 0.3 < repeat_hit_rate("random") < 0.7


# -- isolation: a scope's decisions are a function of its own requests and the loads, nothing else ---

class SharedTableRouter(Router):
    """A known-buggy router (one table for everyone, keys without the scope), as a cache-aware router
    that forgot tenants would be: the property below must catch it."""

    def route(self, scope, prompt_ids, loads, up):
        return super().route("", prompt_ids, loads, up)


events = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=40)


def decisions_of(router_cls, evs, scope="b", with_others=True):
    r = router_cls(2, RoutingConfig(block_size=BS))
    out = []
    for s, prefix, extra in evs:
        if s != scope and not with_others:
            continue
        d = r.route(s, prompt(prefix, blocks=2, tail=0) + [extra], [0, 0], [True, True])
        if s == scope:
            out.append((d.replica, d.kind))
    return out


@settings(max_examples=200, deadline=None)
@given(events)
def test_another_scopes_history_never_changes_a_decision(evs):
    assert decisions_of(Router, evs) == decisions_of(Router, evs, with_others=False)


def test_the_property_catches_a_shared_table():
    evs = [("a", 1, 0), ("b", 1, 0)]  # b sends the prefix a sent: a shared table calls that affinity
    assert decisions_of(SharedTableRouter, evs) != decisions_of(SharedTableRouter, evs, with_others=False)
    assert decisions_of(Router, evs) == decisions_of(Router, evs, with_others=False)
