"""Owns per-request cache policy: block tables, prefix-cache hits, allocation, sealing, freeing.

Does not own the pool's bookkeeping (block_pool.py) nor scheduling (scheduler.py).

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
from isolab.engine.hashing import BlockKey, ExtraKeys, block_key, coarse_block_key, weak
from isolab.engine.request import Request


@dataclass(frozen=True)
class BlockRef:
    """A request's reference to one life of a block (audit compares the generation on every read)."""

    block: KVBlock
    generation: int


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        weights_fingerprint: str,
        dtype: str,
        enable_prefix_caching: bool = True,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.weights_fingerprint = weights_fingerprint
        self.dtype = dtype
        self.enable_prefix_caching = enable_prefix_caching
        self.faults = faults
        # Hits are confirmed against the stored tokens, unless a fault makes the engine trust its key.
        self.confirm_hits = not ({"weak-hash", "coarse-key"} & faults)
        self.write_shared = "write-shared" in faults  # FAULT: unsealed tails shared, no copy-on-write
        self.tables: dict[str, list[BlockRef]] = {}
        # FAULT write-shared only: unsealed blocks published for sharing, by (parent key, scope).
        self.partial_index: dict[tuple[BlockKey | None, str | None], KVBlock] = {}
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
            tokens = request.token_ids[i * bs : (i + 1) * bs]
            if "coarse-key" in self.faults:
                key = coarse_block_key(parent, len(tokens), extra)
            else:
                key = block_key(parent, tokens, extra, with_scope="no-scope" not in self.faults)
            keys.append(weak(key) if "weak-hash" in self.faults else key)
        return keys

    # -- lookup -----------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached blocks that starts the request's tokens: (blocks, num tokens)."""
        if not self.enable_prefix_caching:
            return [], 0
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
        return hits, num_hit

    def count_admission(self, request: Request, num_hit: int) -> None:
        """Prefix-cache statistics, once per admission (a lookup that then finds no room is a retry)."""
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += num_hit

    def _partial_hit(self, request: Request, hits: list[KVBlock], keys: list[BlockKey]) -> KVBlock | None:
        """FAULT write-shared: share another request's unsealed block with no copy-on-write."""
        i = len(hits)
        block = self.partial_index.get((keys[i - 1] if i else None, request.scope))
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
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Give the request blocks for num_computed_tokens + num_new_tokens tokens; False if they cannot be had.

        new_computed_blocks (a prefix-cache hit, first scheduling only) are attached read-only;
        request.num_computed_tokens must already count their tokens.
        """
        hits = new_computed_blocks or []
        table = self.tables.setdefault(request.request_id, [])
        need = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table) - len(hits)
        need = max(need, 0)
        idle_hits = sum(1 for b in hits if b.ref_cnt == 0)  # attaching them takes them off the free queue
        if need + idle_hits > self.pool.num_free_blocks:
            return False
        for block in hits:
            self.pool.touch(block, request.request_id, request.scope)
            table.append(BlockRef(block, block.generation))
        for block in self.pool.allocate(need, request.request_id, request.scope):
            table.append(BlockRef(block, block.generation))
        return True

    def slot(self, request: Request, position: int) -> int:
        ref = self.tables[request.request_id][position // self.block_size]
        return ref.block.block_id * self.block_size + position % self.block_size

    def block_table(self, request: Request) -> list[int]:
        return [ref.block.block_id for ref in self.tables.get(request.request_id, [])]

    # -- after the forward --------------------------------------------------------------------------
    def commit(self, request: Request, start: int, num_new_tokens: int) -> None:
        """Record the tokens whose K/V the forward just wrote at [start, start + n); seal full blocks."""
        bs = self.block_size
        table = self.tables[request.request_id]
        touched: set[int] = set()
        for pos in range(start, start + num_new_tokens):
            block = table[pos // bs].block
            off = pos % bs
            if off < len(block.tokens):
                block.tokens[off] = request.token_ids[pos]  # only a shared block is written twice
                del block.tokens[off + 1 :]
            else:
                if self.write_shared:  # another writer may have cut the block short
                    block.tokens.extend([-1] * (off - len(block.tokens)))
                assert off == len(block.tokens), f"block {block.block_id}: write at {off} after {len(block.tokens)}"
                block.tokens.append(request.token_ids[pos])
            touched.add(pos // bs)
        for i in sorted(touched):
            block = table[i].block
            self.pool.events.emit("written", block.block_id, request.request_id, request.scope, slots=len(block.tokens))
            if len(block.tokens) == bs and block.state is BlockState.ALLOCATED and block.writer == request.request_id:
                if self.enable_prefix_caching:
                    keys = self.update_block_keys(request)
                    if i < len(keys):
                        self.pool.seal(block, keys[i])
            elif self.write_shared and block.state is BlockState.ALLOCATED and self.enable_prefix_caching:
                keys = self.update_block_keys(request)
                self.partial_index[(keys[i - 1] if i else None, request.scope)] = block

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (so the tail is evicted first)."""
        table = self.tables.pop(request.request_id, [])
        for ref in table if self.partial_index else ():
            for k, v in list(self.partial_index.items()):
                if v is ref.block and v.writer == request.request_id:
                    del self.partial_index[k]
        self.pool.release((ref.block for ref in reversed(table)), holder=request.request_id)

    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())
