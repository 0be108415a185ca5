"""Owns the KV blocks' bookkeeping: states, reference counts, the LRU free queue, key -> block map.

Does not own policy (which request gets which block: kv_cache_manager.py) nor the K/V tensors
(a `BlockStorage` clears, poisons and checksums them). Block 0 is the null block: padding in
block tables points at it; it is never allocated, written or freed.

A block's life:  FREE --allocate--> ALLOCATED(one writer) --seal--> SEALED(read-only, shareable)
                   ^                      |                              |
                   +---- release to 0 ----+   (invalidated at once)      |
                   +---- evicted from the free queue when reallocated ---+ (kept for hits until then)

Invariants (checked by `check_invariants`, run after every operation in the state-machine test):
  * ref_cnt == 0  <=>  the block is in the free queue (except the null block).
  * an ALLOCATED block has exactly one holder (ref_cnt == 1) and one writer.
  * key is not None  <=>  cached[key] is this block (the map holds only SEALED blocks).
  * a hit is confirmed against `sealed_tokens`, which only a seal sets and invalidation clears.
  * a FREE block holds no tokens, no key and no writer.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from isolab.engine.events import EventSink, NullSink
from isolab.engine.hashing import BlockKey
from isolab.faults import Faults

NULL_BLOCK_ID = 0


class BlockState(enum.Enum):
    FREE = "free"
    ALLOCATED = "allocated"  # one writer appends to it
    SEALED = "sealed"  # full and immutable; may be shared read-only


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0  # holders; 0 <=> in the free queue
    state: BlockState = BlockState.FREE
    generation: int = 0  # bumped at each allocation: (block_id, generation) names one life
    writer: str | None = None  # the request that writes this life (audit tag)
    scope: str | None = None  # the writer's cache scope
    tokens: list[int] = field(default_factory=list)  # token ids written in this life, in slot order
    key: BlockKey | None = None  # set iff this block is the cached block for `key`
    sealed_tokens: tuple[int, ...] | None = None  # the tokens it held when sealed: hits are confirmed on these
    checksum: bytes | None = None  # audit: digest of the K/V once sealed
    group: int = 0  # the KV cache group whose layers this life holds (kv_groups.py; set at allocation)


class BlockStorage(Protocol):
    def clear(self, block_id: int) -> None: ...  # zero the K/V (a new life starts clean)

    def poison(self, block_id: int) -> None: ...  # fill with NaN (audit: any stale read shows)

    def checksum(self, block_id: int) -> bytes: ...


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        *,
        storage: BlockStorage | None = None,
        audit: bool = False,
        faults: Faults = Faults(),  # reuse-without-invalidate is read here (_evict), and only here
        events: EventSink | None = None,
        clear_on_allocate: bool = False,  # the torch attention reads whole blocks: their unwritten slots too
    ) -> None:
        assert num_blocks >= 2, "the pool needs the null block and at least one more"
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.storage = storage
        self.audit = audit
        self.clear_on_allocate = clear_on_allocate
        self.invalidate_on_reuse = not faults.reuse_without_invalidate
        self.events: EventSink = events or NullSink()
        # LRU order: the front is evicted first. Freed blocks go to the back.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[BlockKey, KVBlock] = {}
        self.num_evictions = 0

    @property
    def null_block(self) -> KVBlock:
        return self.blocks[NULL_BLOCK_ID]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int, writer: str, scope: str | None) -> list[KVBlock]:
        assert self.can_allocate(n), f"asked for {n} blocks, {len(self.free_queue)} free"
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.state is BlockState.SEALED:
                self._evict(block)
            assert block.ref_cnt == 0
            block.generation += 1
            block.state = BlockState.ALLOCATED
            block.ref_cnt = 1
            block.writer, block.scope = writer, scope
            block.tokens = []
            block.key = None  # the map may still hold a stale entry only under reuse-without-invalidate
            block.checksum = None
            if (self.audit or self.clear_on_allocate) and self.storage is not None:
                # unwritten slots must be finite: masked x NaN is NaN (audit poisons freed blocks; on
                # the torch path an earlier life's non-finite value would reach a new writer's row)
                self.storage.clear(block_id)
            self.events.emit("allocated", block_id, writer, scope, generation=block.generation)
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        """A cached, unreferenced block is taken for a new life: forget its key and contents."""
        self.num_evictions += 1
        self.events.emit("evicted", block.block_id, block.writer, block.scope)
        if not self.invalidate_on_reuse:
            # FAULT reuse-without-invalidate: the key map still points here, tokens stay.
            return
        if block.key is not None:
            assert self.cached.get(block.key) is block
            del self.cached[block.key]
            block.key = None
        self._invalidate(block)

    def _invalidate(self, block: KVBlock) -> None:
        block.state = BlockState.FREE
        block.tokens = []
        block.sealed_tokens = None
        block.writer = block.scope = None
        block.checksum = None
        if self.audit and self.storage is not None:
            self.storage.poison(block.block_id)
            self.events.emit("poisoned", block.block_id, None, None)

    # -- sharing -----------------------------------------------------------------------------
    def touch(self, block: KVBlock, reader: str, scope: str | None) -> None:
        """A prefix-cache hit: one more holder. Removes the block from the free queue if idle."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1
        self.events.emit("hit", block.block_id, reader, scope, writer=block.writer, refs=block.ref_cnt)

    def release(self, blocks: Iterable[KVBlock], holder: str | None = None) -> None:
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} released more often than held"
            block.ref_cnt -= 1
            self.events.emit("released", block.block_id, holder, block.scope, refs=block.ref_cnt)
            if block.ref_cnt == 0:
                if block.key is None:  # not findable by any key: nobody may ever read it again
                    self._invalidate(block)
                    self.events.emit("freed", block.block_id, holder, None)
                self.free_queue[block.block_id] = None

    # -- writes --------------------------------------------------------------------------------
    def record_write(self, block: KVBlock, offset: int, token_id: int, *, shared_writers: bool = False) -> None:
        """The forward wrote token_id's K/V into slot `offset` of the block: record its token.

        Slots fill in order: offset == len(tokens) for the one writer. A block shared for
        writing (only under the fault write-shared) can see a second writer rewrite an earlier
        slot, which cuts the block back to that slot, or skip slots another writer cut off
        (filled with -1, which no real token equals); shared_writers says the caller allows that.
        """
        assert block.state is BlockState.ALLOCATED, f"block {block.block_id} is {block.state.value}: not writable"
        tokens = block.tokens
        if offset < len(tokens):
            assert shared_writers, f"block {block.block_id}: rewrite of slot {offset} of {len(tokens)} written"
            tokens[offset] = token_id
            del tokens[offset + 1 :]
            return
        if offset > len(tokens):
            assert shared_writers, f"block {block.block_id}: write at {offset} after {len(tokens)}"
            tokens.extend([-1] * (offset - len(tokens)))
        tokens.append(token_id)

    # -- prefix cache ----------------------------------------------------------------------
    def seal(self, block: KVBlock, key: BlockKey) -> bool:
        """Mark a full block immutable and make it findable by `key`. False if `key` is taken."""
        assert block.state is BlockState.ALLOCATED, f"block {block.block_id} sealed twice"
        block.state = BlockState.SEALED
        block.sealed_tokens = tuple(block.tokens)
        if self.storage is not None and self.audit:
            block.checksum = self.storage.checksum(block.block_id)
        self.events.emit("sealed", block.block_id, block.writer, block.scope)
        holder = self.cached.get(key)
        if holder is not None and holder.key == key:
            return False  # an identical block is cached already; this one stays private
        self.cached[key] = block
        block.key = key
        return True

    def lookup(self, key: BlockKey) -> KVBlock | None:
        return self.cached.get(key)

    # -- checking ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        null = self.null_block
        assert null.ref_cnt == 0 and null.state is BlockState.FREE and NULL_BLOCK_ID not in self.free_queue
        for block in self.blocks[1:]:
            in_queue = block.block_id in self.free_queue
            assert (block.ref_cnt == 0) == in_queue, f"block {block.block_id}: ref {block.ref_cnt}, queued {in_queue}"
            if block.state is BlockState.ALLOCATED:
                assert block.ref_cnt == 1 and block.writer is not None, f"block {block.block_id} has {block.ref_cnt} holders"
            if block.state is BlockState.FREE:
                assert block.ref_cnt == 0 and block.key is None and not block.tokens and block.writer is None
                assert block.sealed_tokens is None
            if block.key is not None:
                assert self.cached.get(block.key) is block
        for key, block in self.cached.items():
            assert block.key == key and block.state is BlockState.SEALED, (
                f"the prefix-cache map sends a key to block {block.block_id}, which was reused ({block.state.value})"
            )
