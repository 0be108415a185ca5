"""Owns what the probe can see of isolab's fault catalogue from outside: fault -> scenario, or why not.

Measured by running `isolab probe` against `isolab serve --inject-fault NAME` (docs/probe.md).
"""

from __future__ import annotations

from isolab.engine.faults import FAULTS

# fault -> (the scenario that fails, or None when invisible from outside; how it shows / why not)
FAULT_VISIBILITY: dict[str, tuple[str | None, str]] = {
    "reuse-without-invalidate": (
        "reuse",
        "only under KV-cache pressure: a cached block must be evicted and handed to a request that is still "
        "writing it when the prefix is asked for again. The probe's flood creates that pressure only on a "
        "server with a small KV pool (e.g. --kv-cache-memory 2MiB); on a large pool nothing is evicted during "
        "the run, the check reports 'no eviction observed' (INCONCLUSIVE, opt-in) and the fault stays invisible",
    ),
    "coarse-key": ("prefix-cache", "a novel prompt of the same length reports cached_tokens it never shared, and "
                   "its output differs from its cold run"),
    "no-scope": ("tenants", "the other tenant (key or cache_salt) is served cached_tokens > 0 for the owner's prompt"),
    "weak-hash": ("prefix-cache", "among ~100 novel first blocks some 8-bit keys collide: cached_tokens > 0 for "
                  "prompts that share nothing with earlier ones"),
    "write-shared": ("prefix-cache", "a prompt that extends a running request's prompt corrupts one of the two: "
                     "outputs differ from their cold runs"),
    "shared-rng": ("seeded", "the same seeded request is not reproducible, alone or under load"),
}
assert set(FAULT_VISIBILITY) == set(FAULTS), "every fault in the catalogue needs a row"
