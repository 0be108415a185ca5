"""Owns what the probe can see of isolab's fault catalogue from outside: fault -> scenario, or why not.

Measured by running `isolab probe` against `isolab serve --inject-fault NAME` (docs/probe.md).
"""

from __future__ import annotations

from isolab.faults import FAULTS

# fault -> (the scenario that fails, or None when invisible from outside; how it shows / why not)
FAULT_VISIBILITY: dict[str, tuple[str | None, str]] = {
    "reuse-without-invalidate": (
        "seeded, and at times concurrency, prefix-cache or reuse (under KV-cache pressure only)",
        "only when a cached block is evicted and handed to a request that is still writing it while the prefix "
        "is asked for again. On a small KV pool (6 MiB for SmolLM2-135M: 16 blocks) the probe's floods cause "
        "exactly that, and warm or loaded runs read another request's KV (logprobs move by 1.5-2.4 nats, seeded "
        "samples change). On a large pool (the default 2 GiB) nothing is evicted during a run: invisible from "
        "outside, and 'evict and re-hit' says so (no eviction observed)",
    ),
    "coarse-key": ("prefix-cache", "a novel prompt of the same length reports cached_tokens it never shared, and "
                   "its output differs from its cold run"),
    "no-scope": ("tenants", "the other tenant (key or cache_salt) is served cached_tokens > 0 for the owner's prompt"),
    "weak-hash": ("prefix-cache", "among ~100 novel first blocks some 8-bit keys collide: cached_tokens > 0 for "
                  "prompts that share nothing with earlier ones"),
    "write-shared": ("prefix-cache", "a prompt that extends a running request's prompt corrupts one of the two: "
                     "outputs differ from their cold runs"),
    "shared-rng": ("seeded", "the same seeded request is not reproducible, alone or under load"),
    "batch-variant-gemm": ("concurrency (with --exact)", "a target's logprobs under load differ from its run alone "
                           "in the last bits; without --exact such differences are batch variance, which the probe "
                           "must tolerate on servers whose numerics are not invariant. /health says "
                           "batch_invariant: false"),
}
assert set(FAULT_VISIBILITY) == set(FAULTS), "every fault in the catalogue needs a row"
