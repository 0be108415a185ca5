"""Owns the routing decision: which replica gets a request, from its scope, its prompt and the loads.

Pure Python, no Ray: the ReplicaSet (replica_set.py) asks, this answers and remembers.

    scope + prompt -> chain of leading-block hashes h1..hk (h0 = H(scope); hi = H(h(i-1) || block i))
    the scope's own table: deepest hi present -> the replica that last took that prefix
    present, up and not hot          -> that replica            ("affinity")
    present but hot or down          -> the least-loaded replica ("balance" / "failover")
    absent (or prompt < one block)   -> the least-loaded replica ("new"; ties by hash, so
                                        different prefixes spread and the same one lands alike)
    then h1..hk -> the chosen replica, in the scope's table

Isolation (the seed's three questions, for the routing table):
- who writes it: only `route`, on the ingress's event loop (one writer), for the request's own scope;
- when: at the routing decision, before the request reaches a replica;
- who sees it: only later decisions of the same scope. A table is found by the scope; nothing reads
  another scope's table, and the hashes start from the scope, so the same tokens under two scopes
  are two unrelated keys. The tables' bounds are per tenant (the owner): a tenant that sends many
  cache_salt values pushes out only its own scopes' tables. What one tenant's routing can learn of
  another is the replicas' load (a count of requests), never whether a prefix was seen. The
  replicas' prefix caches are scoped too.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from isolab.errors import InvalidRequestError

POLICIES = ("affinity", "least-loaded", "random")
DECISIONS = ("affinity", "balance", "failover", "new", "least-loaded", "random")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "affinity"  # affinity (prefix- and tenant-aware) | least-loaded | random (baselines)
    block_size: int = 16  # the engine's KV block: only full blocks are ever cached, so only they route
    max_prefix_blocks: int = 32  # leading blocks hashed (512 tokens): past that a prefix routes alike
    # A replica is hot when its load exceeds the least-loaded one's by balance_abs requests AND by the
    # factor balance_rel (SGLang's cache-aware router has the same pair of thresholds).
    balance_abs: int = 8
    balance_rel: float = 1.5
    max_entries_per_scope: int = 4096  # LRU over prefixes; a forgotten prefix routes as new
    # LRU over a tenant's scopes (its cache_salt values), within that tenant only: one tenant's salts
    # never push out another's tables. Tenants are bounded by the key registry; max_owners caps them anyway.
    max_scopes_per_owner: int = 256
    max_owners: int = 4096
    seed: int = 0  # the random policy's own generator

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"routing must be one of {', '.join(POLICIES)}, not {self.policy!r}",
                                      field="routing")
        if self.block_size < 1 or self.max_prefix_blocks < 1 or self.balance_abs < 0 or self.balance_rel < 1:
            raise InvalidRequestError("block_size and max_prefix_blocks must be >= 1, balance_abs >= 0, "
                                      "balance_rel >= 1", field="routing")


@dataclass(frozen=True)
class Decision:
    replica: int
    kind: str  # one of DECISIONS


def prefix_hashes(scope: str, prompt_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """h1..hk over the prompt's full leading blocks (k <= max_blocks), chained from the scope."""
    h = hashlib.blake2b(scope.encode(), digest_size=16, person=b"isolab-route").digest()
    out = []
    for i in range(min(len(prompt_ids) // block_size, max_blocks)):
        block = prompt_ids[i * block_size:(i + 1) * block_size]
        h = hashlib.blake2b(h + b"".join(int(t).to_bytes(4, "little") for t in block), digest_size=16).digest()
        out.append(h)
    return out


class Router:
    def __init__(self, num_replicas: int, config: RoutingConfig | None = None) -> None:
        assert num_replicas >= 1
        self.num_replicas = num_replicas
        self.config = config or RoutingConfig()
        # owner (tenant) -> scope -> prefix hash -> replica, each level LRU. Written and read only by
        # route() and forget_replica(), on one thread.
        self._tables: OrderedDict[str, OrderedDict[str, OrderedDict[bytes, int]]] = OrderedDict()
        self._rng = random.Random(self.config.seed)

    def route(self, scope: str, prompt_ids: Sequence[int], loads: Sequence[int], up: Sequence[bool],
              owner: str | None = None) -> Decision | None:
        """The replica for this request; None when no replica is up. loads: engine requests in flight.
        owner: the tenant the scope belongs to (default: the scope itself); its scopes share a bound."""
        assert len(loads) == len(up) == self.num_replicas
        alive = [i for i in range(self.num_replicas) if up[i]]
        if not alive:
            return None
        cfg = self.config
        if cfg.policy == "random":
            return Decision(self._rng.choice(alive), "random")
        hashes = prefix_hashes(scope, prompt_ids, cfg.block_size, cfg.max_prefix_blocks)
        tie = int.from_bytes((hashes[0] if hashes else hashlib.blake2b(scope.encode(), digest_size=8).digest())[:8],
                             "little")
        if cfg.policy == "least-loaded":
            return Decision(self._least_loaded(alive, loads, tie), "least-loaded")
        table = self._table(owner if owner is not None else scope, scope)
        known = next((table[h] for h in reversed(hashes) if h in table), None)
        if known is None:
            decision = Decision(self._least_loaded(alive, loads, tie), "new")
        elif not up[known]:
            decision = Decision(self._least_loaded(alive, loads, tie), "failover")
        elif self._hot(known, alive, loads):
            decision = Decision(self._least_loaded(alive, loads, tie), "balance")
        else:
            decision = Decision(known, "affinity")
        for h in hashes:
            table[h] = decision.replica
            table.move_to_end(h)
        while len(table) > cfg.max_entries_per_scope:
            table.popitem(last=False)
        return decision

    def forget_replica(self, replica: int) -> None:
        """The replica restarted (its cache is empty): its prefixes route as new again."""
        for scopes in self._tables.values():
            for table in scopes.values():
                for h in [h for h, r in table.items() if r == replica]:
                    del table[h]

    def num_entries(self, scope: str, owner: str | None = None) -> int:
        scopes = self._tables.get(owner if owner is not None else scope)
        table = None if scopes is None else scopes.get(scope)
        return 0 if table is None else len(table)

    def _table(self, owner: str, scope: str) -> OrderedDict[bytes, int]:
        scopes = self._tables.get(owner)
        if scopes is None:
            scopes = self._tables[owner] = OrderedDict()
            while len(self._tables) > self.config.max_owners:
                self._tables.popitem(last=False)
        self._tables.move_to_end(owner)
        table = scopes.get(scope)
        if table is None:
            table = scopes[scope] = OrderedDict()
            while len(scopes) > self.config.max_scopes_per_owner:
                scopes.popitem(last=False)  # this owner's least recent scope, never another owner's
        scopes.move_to_end(scope)
        return table

    def _hot(self, replica: int, alive: list[int], loads: Sequence[int]) -> bool:
        least = min(loads[i] for i in alive)
        return loads[replica] - least >= self.config.balance_abs and loads[replica] > self.config.balance_rel * least

    @staticmethod
    def _least_loaded(alive: list[int], loads: Sequence[int], tie: int) -> int:
        least = min(loads[i] for i in alive)
        tied = [i for i in alive if loads[i] == least]
        return tied[tie % len(tied)]
