"""Owns per-request cache policy: block tables, prefix-cache hits, allocation, sealing, freeing.

Does not own the pool's bookkeeping (block_pool.py) nor scheduling (scheduler.py), and never
reads a request's num_computed_tokens: the scheduler passes every count explicitly. Blocks leave
this module only as opaque values (`CachedPrefix`, passed from lookup to allocation untouched) or
read-only views (`held_blocks` for the auditor, `slot_mapping` and `block_table` for the runner).

Index arithmetic, block size bs = 4, a request of 10 tokens:

    tokens:   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __
    table:    block 7     | block 3     | block 9 (ALLOCATED, 2 of 4 slots written)
    keys:     k0=H(None,t0..t3,x) | k1=H(k0,t4..t7,x)   (only full blocks have keys)
    slot of position p = table[p // bs].block_id * bs + p % bs

A hit may cover at most num_tokens - 1 tokens (the last token is always computed, to get its
logits), so a request never writes into a block it found in the cache: shared blocks are
read-only by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolab.engine.block_pool import BlockPool, BlockState, KVBlock
from isolab.engine.hashing import BlockKey, ExtraKeys, KeyPolicy
from isolab.engine.request import Request
from isolab.faults import Faults


@dataclass(frozen=True)
class BlockRef:
    """A request's reference to one life of a block (audit compares the generation on every read)."""

    block: KVBlock
    generation: int


@dataclass(frozen=True)
class CachedPrefix:
    """A prefix-cache hit, from get_computed_blocks to allocate_slots: opaque to the scheduler.

    Invariant: num_tokens <= the request's num_tokens - 1 (its last token is always computed).
    """

    blocks: tuple[KVBlock, ...]  # SEALED blocks (or, under write-shared, one ALLOCATED tail) in table order
    num_tokens: int  # the tokens they cover: the request's num_computed_tokens once admitted


NO_PREFIX = CachedPrefix((), 0)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        weights_fingerprint: str,
        dtype: str,
        enable_prefix_caching: bool = True,
        faults: Faults = Faults(),
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.weights_fingerprint = weights_fingerprint
        self.dtype = dtype
        self.enable_prefix_caching = enable_prefix_caching
        self.keys = KeyPolicy(faults)
        self.confirm_hits = faults.confirm_hits  # weak-hash / coarse-key: trust the key alone
        self.write_shared = faults.write_shared  # unsealed tails shared, no copy-on-write
        self._tables: dict[str, list[BlockRef]] = {}  # request id -> its blocks, in position order
        # FAULT write-shared only: unsealed blocks published for sharing, by (parent key, scope).
        self._partial_index: dict[tuple[BlockKey | None, str | None], KVBlock] = {}
        # Counters for metrics (tokens).
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- keys -----------------------------------------------------------------------------------
    def _extra(self, request: Request) -> ExtraKeys:
        return ExtraKeys(self.weights_fingerprint, self.dtype, request.scope)

    def update_block_keys(self, request: Request) -> list[BlockKey]:
        """Extend request.block_keys to cover every full block of its tokens."""
        bs, keys = self.block_size, request.block_keys
        extra = self._extra(request)
        for i in range(len(keys), request.num_tokens // bs):
            parent = keys[i - 1] if i else None
            keys.append(self.keys.key(parent, request.token_ids[i * bs : (i + 1) * bs], extra))
        return keys

    # -- lookup -----------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> CachedPrefix:
        """The longest run of cached blocks that starts the request's tokens."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return NO_PREFIX  # prompt logprobs need every prompt position computed
        bs = self.block_size
        keys = self.update_block_keys(request)
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(keys[i])
            if block is None:
                break
            if self.confirm_hits and block.sealed_tokens != tuple(request.token_ids[i * bs : (i + 1) * bs]):
                break  # a key collision: never share on the key alone
            hits.append(block)
        num_hit = len(hits) * bs
        if self.write_shared:
            extra = self._partial_hit(request, hits, keys)
            if extra is not None:
                hits.append(extra)
                num_hit += len(extra.tokens)
        return CachedPrefix(tuple(hits), num_hit)

    def count_admission(self, request: Request, prefix: CachedPrefix) -> None:
        """Prefix-cache statistics, once per admission (a lookup that then finds no room is a retry)."""
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += prefix.num_tokens

    def _partial_hit(self, request: Request, hits: list[KVBlock], keys: list[BlockKey]) -> KVBlock | None:
        """FAULT write-shared: share another request's unsealed block with no copy-on-write."""
        i = len(hits)
        block = self._partial_index.get((keys[i - 1] if i else None, request.scope))
        if block is None or block.state is not BlockState.ALLOCATED or not block.tokens:
            return None
        start = i * self.block_size
        mine = request.token_ids[start : start + len(block.tokens)]
        if mine != block.tokens or start + len(block.tokens) >= request.num_tokens:
            return None
        return block

    # -- allocation -------------------------------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX
    ) -> bool:
        """Blocks for num_computed_tokens + num_new_tokens tokens; False (and nothing changed) if they cannot be had.

        prefix (a hit, first scheduling only) is attached read-only; num_computed_tokens counts
        its tokens already.
        """
        table = self._tables.get(request.request_id, [])
        need = self.num_blocks_needed(num_computed_tokens + num_new_tokens) - len(table) - len(prefix.blocks)
        need = max(need, 0)
        idle_hits = sum(1 for b in prefix.blocks if b.ref_cnt == 0)  # attaching them takes them off the free queue
        if need + idle_hits > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request.request_id, table)
        for block in prefix.blocks:
            self.pool.touch(block, request.request_id, request.scope)
            table.append(BlockRef(block, block.generation))
        for block in self.pool.allocate(need, request.request_id, request.scope):
            table.append(BlockRef(block, block.generation))
        return True

    # -- what the runner and the auditor read ------------------------------------------------------
    def slot_mapping(self, request: Request, start: int, num_tokens: int) -> list[int]:
        """The flat pool slot of each position in [start, start + num_tokens)."""
        bs, table = self.block_size, self._tables[request.request_id]
        return [table[p // bs].block.block_id * bs + p % bs for p in range(start, start + num_tokens)]

    def block_table(self, request: Request, num_tokens: int | None = None) -> list[int]:
        """Block ids of the request's table, those that hold positions [0, num_tokens) when given."""
        table = self._tables.get(request.request_id, [])
        n = len(table) if num_tokens is None else self.num_blocks_needed(num_tokens)
        return [ref.block.block_id for ref in table[:n]]

    def held_blocks(self, request: Request) -> tuple[BlockRef, ...]:
        """The request's block lives, in position order (read-only: the auditor's view)."""
        return tuple(self._tables.get(request.request_id, ()))

    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self._tables.values())

    # -- after the forward --------------------------------------------------------------------------
    def commit(self, request: Request, start: int, num_new_tokens: int) -> None:
        """Record the tokens whose K/V the forward just wrote at [start, start + n); seal full blocks."""
        bs = self.block_size
        table = self._tables[request.request_id]
        touched: list[int] = []
        for pos in range(start, start + num_new_tokens):
            i = pos // bs
            self.pool.record_write(table[i].block, pos % bs, request.token_ids[pos], shared_writers=self.write_shared)
            if not touched or touched[-1] != i:
                touched.append(i)
        for i in touched:
            block = table[i].block
            self.pool.events.emit("written", block.block_id, request.request_id, request.scope, slots=len(block.tokens))
            if not self.enable_prefix_caching or block.state is not BlockState.ALLOCATED:
                continue
            if len(block.tokens) == bs and block.writer == request.request_id:
                keys = self.update_block_keys(request)
                if i < len(keys):
                    self.pool.seal(block, keys[i])
            elif self.write_shared:
                keys = self.update_block_keys(request)
                self._partial_index[(keys[i - 1] if i else None, request.scope)] = block

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (so the tail is evicted first)."""
        table = self._tables.pop(request.request_id, [])
        if self._partial_index:
            mine = {id(ref.block) for ref in table}
            for k, v in list(self._partial_index.items()):
                if id(v) in mine and v.writer == request.request_id:
                    del self._partial_index[k]
        self.pool.release((ref.block for ref in reversed(table)), holder=request.request_id)
