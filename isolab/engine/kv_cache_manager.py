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

KV cache groups (kv_groups.py): a request holds one table per group, every table covering the same
positions. A sliding-window group (window W) frees, at each allocation, the blocks its next query
can no longer read (kv_groups.first_needed_block), and its table points them at the null block:

    W 8, bs 4, 13 computed:  full group     block 7 | block 3 | block 9 | block 2
                             window group   null    | block 5 | block 8 | block 6
                                            (freed: the next query reads t6..t13 only)

Freed like any released block: kept for hits if sealed, invalidated (poisoned under audit)
otherwise. Group g's block keys are derived from the request's chain key (KeyPolicy.group_key), so
a block is only ever found by its own group. A hit of k blocks needs every full-attention group's
blocks 0..k-1 and every window group's blocks first_needed_block(k * bs)..k-1 (if some of those
were evicted, the hit is shorter): what a miss would leave in the tables, minus freed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolab.engine.block_pool import BlockPool, BlockState, KVBlock
from isolab.engine.hashing import BlockKey, ExtraKeys, KeyPolicy
from isolab.engine.kv_groups import first_needed_block
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

    blocks: tuple[tuple[KVBlock, ...], ...]  # per group: SEALED blocks (or, under write-shared, one
    #   ALLOCATED tail) in table order, from table index starts[g] on; () for no hit
    num_tokens: int  # the tokens they cover: the request's num_computed_tokens once admitted
    starts: tuple[int, ...] = ()  # per group: the table index of blocks[g][0] (> 0 only for window groups)

    def start(self, group: int) -> int:
        return self.starts[group] if self.starts else 0

    def group_blocks(self, group: int) -> tuple[KVBlock, ...]:
        return self.blocks[group] if self.blocks else ()


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
        windows: tuple[int, ...] = (0,),
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = windows  # per KV cache group (kv_groups.py): 0 = full attention, else the window
        self._null = BlockRef(pool.null_block, 0)  # a window group's freed entries
        self.weights_fingerprint = weights_fingerprint
        self.dtype = dtype
        self.enable_prefix_caching = enable_prefix_caching
        self.keys = KeyPolicy(faults)
        self.confirm_hits = faults.confirm_hits  # weak-hash / coarse-key: trust the key alone
        self.write_shared = faults.write_shared  # unsealed tails shared, no copy-on-write
        # request id -> one table per group, each its blocks in position order (window groups: the
        # null ref for blocks freed as they left the window)
        self._tables: dict[str, list[list[BlockRef]]] = {}
        # FAULT write-shared only: unsealed blocks published for sharing, by (group, parent key, scope).
        self._partial_index: dict[tuple[int, BlockKey | None, str | None], KVBlock] = {}
        # Counters for metrics (tokens).
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- keys -----------------------------------------------------------------------------------
    def _extra(self, request: Request) -> ExtraKeys:
        return ExtraKeys(self.weights_fingerprint, self.dtype, request.scope)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _group_key(self, key: BlockKey, group: int) -> BlockKey:
        return self.keys.group_key(key, group)

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
        """The longest prefix of the request's tokens whose blocks every group would read next are
        cached: full-attention groups all its blocks, window groups those of its last window."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return NO_PREFIX  # prompt logprobs need every prompt position computed
        bs = self.block_size
        keys = self.update_block_keys(request)
        max_blocks = (request.num_tokens - 1) // bs
        tokens = request.token_ids

        def cached(group: int, i: int) -> KVBlock | None:
            block = self.pool.lookup(self._group_key(keys[i], group))
            if block is None:
                return None
            if self.confirm_hits and block.sealed_tokens != tuple(tokens[i * bs : (i + 1) * bs]):
                return None  # a key collision: never share on the key alone
            return block

        # full-attention groups: the longest run of cached blocks from block 0
        k = max_blocks
        found: dict[int, list[KVBlock | None]] = {}
        for g, window in enumerate(self.windows):
            if window:
                continue
            run: list[KVBlock | None] = []
            for i in range(k):
                block = cached(g, i)
                if block is None:
                    break
                run.append(block)
            found[g] = run
            k = len(run)
        # window groups: the longest k whose window blocks first_needed_block(k * bs)..k-1 are cached,
        # looked up lazily (only window blocks, each once): a block missing at index j rules out every
        # k' in (j, k], since their windows start at or before j (first_needed_block grows with k)
        looked: dict[tuple[int, int], KVBlock | None] = {}

        def window_block(g: int, i: int) -> KVBlock | None:
            if (g, i) not in looked:
                looked[g, i] = cached(g, i)
            return looked[g, i]

        def missing(k: int) -> int | None:
            for g, w in enumerate(self.windows):
                if w:
                    for i in reversed(range(first_needed_block(k * bs, w, bs), k)):
                        if window_block(g, i) is None:
                            return i
            return None

        while k > 0 and (j := missing(k)) is not None:
            k = j
        starts = tuple(first_needed_block(k * bs, w, bs) for w in self.windows)
        hits = [list(found[g][starts[g] : k]) if not w else [window_block(g, i) for i in range(starts[g], k)]
                for g, w in enumerate(self.windows)]
        num_hit = k * bs
        if self.write_shared:
            extra = [self._partial_hit(request, g, k, keys) for g in range(self.num_groups)]
            if all(e is not None for e in extra) and len({len(e.tokens) for e in extra if e is not None}) == 1:
                for g, e in enumerate(extra):
                    hits[g].append(e)
                num_hit += len(extra[0].tokens)  # type: ignore[union-attr]
        if num_hit == 0:
            return NO_PREFIX
        return CachedPrefix(tuple(tuple(h) for h in hits), num_hit, starts)  # type: ignore[arg-type]

    def count_admission(self, request: Request, prefix: CachedPrefix) -> None:
        """Prefix-cache statistics, once per admission (a lookup that then finds no room is a retry)."""
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += prefix.num_tokens

    def _partial_hit(self, request: Request, group: int, i: int, keys: list[BlockKey]) -> KVBlock | None:
        """FAULT write-shared: share another request's unsealed block i with no copy-on-write."""
        block = self._partial_index.get((group, keys[i - 1] if i else None, request.scope))
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

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks, all groups together, a request of num_tokens holds at once when it computes
        at most max_chunk tokens a step: a window group holds the chunk's blocks and those of the
        window - 1 keys before it, (window - 1 + max_chunk) // bs + 2 at most."""
        full = self.num_blocks_needed(num_tokens)
        return sum(full if not w else min(full, (w - 1 + max_chunk) // self.block_size + 2) for w in self.windows)

    def allocate_slots(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX
    ) -> bool:
        """Blocks for num_computed_tokens + num_new_tokens tokens; False (and nothing allocated) if they
        cannot be had. Window groups first free the blocks that left their window (whatever follows).

        prefix (a hit, first scheduling only) is attached read-only; num_computed_tokens counts
        its tokens already.
        """
        tables = self._tables.get(request.request_id)
        if tables is not None:
            self._free_outside_windows(request, tables, num_computed_tokens)
        else:
            tables = [[self._null] * prefix.start(g) for g in range(self.num_groups)]
        total = self.num_blocks_needed(num_computed_tokens + num_new_tokens)
        needs = [max(total - len(t) - len(prefix.group_blocks(g)), 0) for g, t in enumerate(tables)]
        idle_hits = sum(1 for g in range(self.num_groups) for b in prefix.group_blocks(g) if b.ref_cnt == 0)
        if sum(needs) + idle_hits > self.pool.num_free_blocks:  # attaching idle hits takes them off the free queue
            return False
        self._tables.setdefault(request.request_id, tables)
        for g, table in enumerate(tables):  # every group's hits leave the free queue before any allocation,
            for block in prefix.group_blocks(g):  # which would otherwise evict one of them
                self.pool.touch(block, request.request_id, request.scope)
                table.append(BlockRef(block, block.generation))
        for g, table in enumerate(tables):
            for block in self.pool.allocate(needs[g], request.request_id, request.scope):
                block.group = g  # this life holds group g's layers: the audit checks every reader's group
                table.append(BlockRef(block, block.generation))
        return True

    def _free_outside_windows(self, request: Request, tables: list[list[BlockRef]], num_computed_tokens: int) -> None:
        """Window groups: release the blocks the next query (position num_computed_tokens) cannot
        read, oldest first (so they are evicted first), and point their entries at the null block."""
        for g, window in enumerate(self.windows):
            if not window:
                continue
            table = tables[g]
            first = min(first_needed_block(num_computed_tokens, window, self.block_size), len(table))
            gone = [ref.block for ref in table[:first] if ref is not self._null]
            if gone:
                table[:first] = [self._null] * first
                self._forget_partial(request, gone)
                self.pool.release(gone, holder=request.request_id)

    # -- what the runner and the auditor read ------------------------------------------------------
    def slot_mapping(self, request: Request, start: int, num_tokens: int, group: int = 0) -> list[int]:
        """The flat pool slot of each position in [start, start + num_tokens), in group's blocks."""
        bs, table = self.block_size, self._tables[request.request_id][group]
        return [table[p // bs].block.block_id * bs + p % bs for p in range(start, start + num_tokens)]

    def block_table(self, request: Request, num_tokens: int | None = None, group: int = 0) -> list[int]:
        """Block ids of the request's table in group, those that hold positions [0, num_tokens) when
        given (a window group's freed entries are the null block, 0)."""
        tables = self._tables.get(request.request_id)
        table = tables[group] if tables else []
        n = len(table) if num_tokens is None else self.num_blocks_needed(num_tokens)
        return [ref.block.block_id for ref in table[:n]]

    def held_blocks(self, request: Request, group: int = 0) -> tuple[BlockRef, ...]:
        """The request's block lives in group, in position order (read-only: the auditor's view); a
        window group's freed entries are the null block's ref."""
        tables = self._tables.get(request.request_id)
        return tuple(tables[group]) if tables else ()

    def num_held_blocks(self) -> int:
        return sum(self.num_held_blocks_by_group())

    def num_held_blocks_by_group(self) -> list[int]:
        """Blocks the running requests hold, per group (a block shared by two counts twice)."""
        held = [0] * self.num_groups
        for tables in self._tables.values():
            for g, table in enumerate(tables):
                held[g] += sum(1 for ref in table if ref is not self._null)
        return held

    # -- after the forward --------------------------------------------------------------------------
    def commit(self, request: Request, start: int, num_new_tokens: int) -> None:
        """Record the tokens whose K/V the forward just wrote at [start, start + n); seal full blocks."""
        for g, table in enumerate(self._tables[request.request_id]):
            self._commit_group(request, g, table, start, num_new_tokens)

    def _commit_group(self, request: Request, group: int, table: list[BlockRef], start: int, num_new_tokens: int) -> None:
        bs = self.block_size
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
                    self.pool.seal(block, self._group_key(keys[i], group))
            elif self.write_shared:
                keys = self.update_block_keys(request)
                self._partial_index[(group, keys[i - 1] if i else None, request.scope)] = block

    def free(self, request: Request) -> None:
        """Release every block the request holds, the tail position first across all groups (so tails
        are evicted first: a hit needs every group's blocks of its prefix, so no group's head may go
        before another group's tail)."""
        tables = self._tables.pop(request.request_id, [])
        n = max((len(t) for t in tables), default=0)
        held = [t[i].block for i in reversed(range(n)) for t in tables if i < len(t) and t[i] is not self._null]
        self._forget_partial(request, held)
        self.pool.release(held, holder=request.request_id)

    def _forget_partial(self, request: Request, blocks: list[KVBlock]) -> None:
        if self._partial_index:
            mine = {id(b) for b in blocks}
            for k, v in list(self._partial_index.items()):
                if id(v) in mine and v.writer == request.request_id:
                    del self._partial_index[k]
