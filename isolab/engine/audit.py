"""Owns audit mode: writer tags checked on every read and write (claim C13, the "surveillance camera").

Before each forward, for every scheduled chunk:
  * writes: every block that receives this chunk's K/V must be ALLOCATED to this request alone,
    in the life (generation) the request attached;
  * reads: every block in the request's context must be the life it attached, and either its
    own (ALLOCATED, writer = reader) or SEALED with the reader's scope, the reader's tokens and
    an intact checksum.
  * KV cache groups (kv_groups.py): every group's table is checked; a sliding-window group's
    entries before the chunk's window (kv_groups.first_needed_block) are not read (the manager has
    released them); every entry it reads must be a block the reader still holds, never the null block.
A violation names the reader, the block and the writer. Freed blocks are NaN-poisoned by the
pool, so a read the tags miss still shows up as NaN.
"""

from __future__ import annotations

from isolab.engine.block_pool import NULL_BLOCK_ID, BlockState, KVBlock
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.kv_groups import first_needed_block
from isolab.engine.kv_storage import KVStorage
from isolab.engine.request import Request
from isolab.engine.step import ScheduledChunk
from isolab.errors import IsolationViolation


def _violation(kind: str, reader: Request, block: KVBlock, why: str) -> IsolationViolation:
    """kind: "read" or "write"."""
    writer = block.writer
    msg = (
        f"isolation violation ({kind}): request {reader.request_id} (scope {reader.scope!r}) {kind}s block "
        f"{block.block_id} written by {'request ' + writer if writer else 'nobody'} (scope {block.scope!r}, "
        f"{block.state.value}, generation {block.generation}): {why}"
    )
    return IsolationViolation(msg, reader=reader.request_id, block_id=block.block_id, writer=writer, kind=kind)


class Auditor:
    def __init__(self, kv: KVCacheManager, storage: KVStorage) -> None:
        self.kv = kv
        self.storage = storage
        self.num_checks = 0
        self.violations: list[IsolationViolation] = []
        self._verified: set[tuple[str, int, int]] = set()  # (reader, block, generation) whose checksum held

    def check_chunk(self, ch: ScheduledChunk) -> IsolationViolation | None:
        for group, window in enumerate(self.kv.windows):
            v = self._check_group(ch, group, window)
            if v is not None:
                return v
        return None

    def _check_group(self, ch: ScheduledChunk, group: int, window: int) -> IsolationViolation | None:
        req, bs = ch.request, self.kv.block_size
        table = self.kv.held_blocks(req, group)
        first_read = first_needed_block(ch.start, window, bs)  # 0 for full attention
        first_write = ch.start // bs
        last = (ch.start + ch.num_new_tokens - 1) // bs
        for i in range(last + 1):
            ref = table[i]
            b = ref.block
            self.num_checks += 1
            if i < first_read:
                continue  # outside every query's window: not read (the null block once released)
            if b.block_id == NULL_BLOCK_ID:
                return self._record(_violation("read", req, b, f"a released entry {i} of KV group {group} is in the window"))
            if ref.generation != b.generation:
                return self._record(_violation("read", req, b, f"the block was reused since generation {ref.generation}"))
            if b.group != group:  # the same positions of other layers: a key that forgot its group
                return self._record(_violation("read", req, b, f"a block of KV group {b.group} in group {group}'s table"))
            if b.ref_cnt == 0:
                return self._record(_violation("read", req, b, "the reader released the block: nobody holds it"))
            own = b.state is BlockState.ALLOCATED and b.writer == req.request_id
            if i >= first_write:
                if not own or b.ref_cnt != 1:
                    why = "a shared or foreign block must never be written"  # shared (ref_cnt > 1) or not the writer's
                    return self._record(_violation("write", req, b, why))
                continue
            if own:
                continue
            if b.state is not BlockState.SEALED:
                return self._record(_violation("read", req, b, "the block is neither the reader's nor sealed"))
            if b.scope != req.scope:
                return self._record(_violation("read", req, b, "the block's scope does not admit the reader"))
            if b.sealed_tokens != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                return self._record(_violation("read", req, b, "the block holds other tokens than the reader's"))
            tag = (req.request_id, b.block_id, b.generation)
            if tag not in self._verified:
                if b.checksum is not None and self.storage.checksum(b.block_id) != b.checksum:
                    return self._record(_violation("read", req, b, "the sealed block's contents changed"))
                self._verified.add(tag)
        return None

    def forget(self, request_id: str) -> None:
        self._verified = {t for t in self._verified if t[0] != request_id}

    def _record(self, v: IsolationViolation) -> IsolationViolation:
        self.violations.append(v)
        self.kv.pool.events.emit("violation", v.block_id, v.reader, None, writer=v.writer, access=v.kind)
        return v
