"""Owns the fault catalogue: each name switches one isolation protection off, for fault injection.

Does not know the engine: the engine reads a `Faults` value, built once from names at start-up,
and each protection checks its own flag in exactly one place (named in the table below). Never
on by default. Each fault must produce a wrong output that the project's own checks catch
(tests/engine/test_faults.py; `isolab selftest` runs the catalogue). Imports nothing of isolab
but errors, so the black-box probe can name the catalogue without loading an engine.

    fault                     protection switched off               the one place it is read
    reuse-without-invalidate  freed blocks invalidated on reuse     block_pool.BlockPool._evict
    coarse-key                key names the block's tokens          hashing.KeyPolicy.key
    no-scope                  key names the tenant's cache scope    hashing.KeyPolicy.key
    weak-hash                 full-width key + hit confirmation     hashing.KeyPolicy.key,
                                                                    kv_cache_manager (confirm_hits)
    write-shared              one writer per block (copy-on-write)  kv_cache_manager (partial hits)
    shared-rng                one generator per request             model_runner.ModelRunner (sampling)
    batch-variant-gemm        invariant GEMM at start-up            llm_engine (GEMM path choice)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from isolab.errors import InvalidRequestError

FAULTS: dict[str, str] = {
    "reuse-without-invalidate": "a freed block is handed out again without being invalidated: its old "
    "contents and length stay reachable by the next owner",
    "coarse-key": "the prefix-cache key is the block's position and token count only, not its tokens",
    "no-scope": "the request's cache scope (tenant) is left out of the prefix-cache key",
    "weak-hash": "the prefix-cache key is truncated to 8 bits and hits are not confirmed against the stored tokens",
    "write-shared": "a request writes its tokens into a block that other requests share read-only",
    "shared-rng": "one random generator serves all requests instead of one per request",
    "batch-variant-gemm": "the GEMMs split their reduction over K when M >= 8 (as libraries pick kernels by M), "
    "so a row's bits depend on how many rows share its step; the start-up invariance check is overruled",
}


@dataclass(frozen=True)
class Faults:
    """Which protections are off. The default value, Faults(), is the healthy engine."""

    reuse_without_invalidate: bool = False
    coarse_key: bool = False
    no_scope: bool = False
    weak_hash: bool = False
    write_shared: bool = False
    shared_rng: bool = False
    batch_variant_gemm: bool = False

    @classmethod
    def from_names(cls, names: Iterable[str]) -> Faults:
        """Faults from catalogue names; an unknown name is an InvalidRequestError naming the catalogue."""
        names = tuple(names)
        validate_faults(names)
        return cls(**{name.replace("-", "_"): True for name in names})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name))

    @property
    def confirm_hits(self) -> bool:
        """Hits are confirmed against the stored tokens unless a fault makes the engine trust its key."""
        return not (self.weak_hash or self.coarse_key)

    def __bool__(self) -> bool:
        return bool(self.names)


assert {f.name.replace("_", "-") for f in fields(Faults)} == set(FAULTS), "one flag per catalogue entry"


def validate_faults(names: Iterable[str]) -> None:
    for name in names:
        if name not in FAULTS:
            raise InvalidRequestError(
                f"unknown fault {name!r}; the catalogue is: {', '.join(FAULTS)}", field="inject_faults"
            )
