"""Owns the fault catalogue: each name switches one isolation protection off, for fault injection.

Never on by default. Each fault must produce a wrong output that the project's own checks catch
(tests/engine/test_faults.py; `isolab selftest` runs the catalogue).
"""

from __future__ import annotations

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


def validate_faults(names: frozenset[str] | set[str] | tuple[str, ...]) -> None:
    for name in names:
        if name not in FAULTS:
            raise InvalidRequestError(
                f"unknown fault {name!r}; the catalogue is: {', '.join(FAULTS)}", field="inject_faults"
            )
