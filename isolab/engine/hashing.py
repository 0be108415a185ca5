"""Owns prefix-cache keys: SHA-256 over a canonical, typed, length-prefixed encoding.

    key(block i) = SHA-256( enc(parent key) || enc(token ids of block i) || enc(extra keys) )

Every field is written as <type tag (1 byte)><length (8 bytes, big-endian)><payload>, so no two
different field lists encode to the same bytes (the ambiguity behind vllm#44701, where a salt
"X" hit the adapter "X"). The extra keys name everything besides the tokens that shapes a
block's K/V values: the weights (fingerprint), the compute dtype, and the request's cache scope
(the tenant). Requests of different scopes therefore never share a block.

With several KV cache groups (kv_groups.py), group g > 0's block i is cached under
SHA-256( enc(g) || enc(key i) ): a block is only found by the group whose layers it holds.
Group 0's key is the chain key itself (a model of one group keys its blocks as it always did).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from isolab.faults import Faults

BlockKey = NewType("BlockKey", bytes)

_TAG_NONE, _TAG_BYTES, _TAG_STR, _TAG_INTS, _TAG_INT = b"N", b"B", b"S", b"I", b"i"


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack(">Q", len(payload)) + payload


def encode_ints(values: Sequence[int]) -> bytes:
    return _field(_TAG_INTS, struct.pack(f">{len(values)}q", *values))


def encode_str(value: str | None) -> bytes:
    return _field(_TAG_NONE, b"") if value is None else _field(_TAG_STR, value.encode("utf-8"))


@dataclass(frozen=True)
class ExtraKeys:
    """Everything besides the tokens that shapes a block's K/V values."""

    weights_fingerprint: str  # SHA-256 of the model file
    dtype: str  # "bf16/native" ... (ModelBundle.numerics_key): the same file gives other K/V bits in another dtype or weight format
    scope: str | None  # the request's cache scope (tenant); None = the default scope

    def encode(self, *, with_scope: bool = True) -> bytes:
        return (
            encode_str(self.weights_fingerprint)
            + encode_str(self.dtype)
            + (encode_str(self.scope) if with_scope else encode_str(None))
        )


def block_key(parent: BlockKey | None, token_ids: Sequence[int], extra: ExtraKeys, *, with_scope: bool = True) -> BlockKey:
    """with_scope=False only under the fault no-scope (KeyPolicy)."""
    parent_field = _field(_TAG_NONE, b"") if parent is None else _field(_TAG_BYTES, parent)
    payload = parent_field + encode_ints(token_ids) + extra.encode(with_scope=with_scope)
    return BlockKey(hashlib.sha256(payload).digest())


def coarse_block_key(parent: BlockKey | None, num_tokens: int, extra: ExtraKeys) -> BlockKey:
    """FAULT coarse-key: the key names the chain position and the token count, not the tokens."""
    parent_field = _field(_TAG_NONE, b"") if parent is None else _field(_TAG_BYTES, parent)
    payload = parent_field + _field(_TAG_INT, struct.pack(">q", num_tokens)) + extra.encode()
    return BlockKey(hashlib.sha256(payload).digest())


def group_block_key(key: BlockKey, group: int) -> BlockKey:
    """The key of a block of KV cache group `group` whose chain key is `key` (group 0: key itself)."""
    if group == 0:
        return key
    return BlockKey(hashlib.sha256(_field(_TAG_INT, struct.pack(">q", group)) + _field(_TAG_BYTES, key)).digest())


def weak(key: BlockKey) -> BlockKey:
    """FAULT weak-hash: the key truncated to 8 bits (256 buckets: collisions are certain)."""
    return BlockKey(key[:1])


@dataclass(frozen=True)
class KeyPolicy:
    """The one place a block's key is made: healthy, or weakened by a key fault (isolab.faults)."""

    faults: Faults = Faults()

    def key(self, parent: BlockKey | None, token_ids: Sequence[int], extra: ExtraKeys) -> BlockKey:
        if self.faults.coarse_key:
            k = coarse_block_key(parent, len(token_ids), extra)
        else:
            k = block_key(parent, token_ids, extra, with_scope=not self.faults.no_scope)
        return weak(k) if self.faults.weak_hash else k

    def group_key(self, key: BlockKey, group: int) -> BlockKey:
        """Group `group`'s cache key for the block whose (policy-made) chain key is `key`."""
        k = group_block_key(key, group)
        return weak(k) if self.faults.weak_hash and group else k
