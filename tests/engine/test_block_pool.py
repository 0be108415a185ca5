"""Exact-id unit tests of the block pool and the cache manager on tiny sizes."""

from __future__ import annotations

import pytest

from isolab.engine.block_pool import BlockPool, BlockState
from isolab.engine.hashing import ExtraKeys, block_key, coarse_block_key, encode_str, weak
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.request import Request
from isolab.faults import Faults
from isolab.sampling_params import SamplingParams

BS = 4


def mgr(num_blocks=12, **kw) -> KVCacheManager:
    pool = BlockPool(num_blocks)
    return KVCacheManager(pool, BS, weights_fingerprint="w" * 64, dtype="bf16", **kw)


def req(rid: str, tokens, scope=None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), scope)


def run_prompt(m: KVCacheManager, r: Request) -> int:
    """Schedule the whole prompt at once, as the scheduler would on an empty engine."""
    prefix = m.get_computed_blocks(r)
    n = prefix.num_tokens
    assert m.allocate_slots(r, n, r.num_tokens - n, prefix)
    m.commit(r, n, r.num_tokens - n)
    return n


def test_allocation_order_and_lru_free_queue():
    pool = BlockPool(5)
    a = pool.allocate(2, "a", None)
    assert [b.block_id for b in a] == [1, 2]
    assert list(pool.free_queue) == [3, 4]
    pool.release(reversed(a), "a")
    assert list(pool.free_queue) == [3, 4, 2, 1]  # freed tail first: evicted first
    assert all(b.state is BlockState.FREE for b in a)
    pool.check_invariants()


def test_one_writer_fills_slots_in_order_and_never_rewrites():
    """A block with one writer fills its slots in order; a rewrite or a skipped slot is refused
    (only the fault write-shared, which lets two requests write one block, passes shared_writers)."""
    pool = BlockPool(3)
    (block,) = pool.allocate(1, "a", None)
    for i, tok in enumerate((7, 8, 9)):
        pool.record_write(block, i, tok)
    assert block.tokens == [7, 8, 9]
    with pytest.raises(AssertionError, match="rewrite of slot 1"):
        pool.record_write(block, 1, 5)
    with pytest.raises(AssertionError, match="write at 4 after 3"):
        pool.record_write(block, 4, 5)
    assert block.tokens == [7, 8, 9]
    pool.record_write(block, 1, 5, shared_writers=True)  # a second writer cuts the block back
    assert block.tokens == [7, 5]


def test_null_block_is_never_handed_out():
    pool = BlockPool(3)
    assert [b.block_id for b in pool.allocate(2, "a", None)] == [1, 2]
    assert not pool.can_allocate(1)


def test_full_blocks_are_sealed_and_hit_exactly():
    m = mgr()
    a = req("a", range(10, 20))  # 10 tokens: blocks [10..13] [14..17] [18 19]
    assert run_prompt(m, a) == 0
    assert m.block_table(a) == [1, 2, 3]
    assert [m.pool.blocks[i].state for i in (1, 2, 3)] == [BlockState.SEALED, BlockState.SEALED, BlockState.ALLOCATED]
    b = req("b", list(range(10, 18)) + [99, 98, 97])
    assert run_prompt(m, b) == 8  # both full blocks shared
    assert m.block_table(b) == [1, 2, 4]
    assert m.pool.blocks[1].ref_cnt == 2
    m.pool.check_invariants()


def test_hit_never_covers_the_last_token():
    m = mgr()
    run_prompt(m, req("a", range(8)))  # exactly two full blocks
    b = req("b", range(8))
    assert run_prompt(m, b) == 4  # the second block holds the last token: recomputed, not shared
    assert m.block_table(b) == [1, 3]


def test_scopes_never_share():
    m = mgr(num_blocks=12)
    run_prompt(m, req("a", range(10), scope="tenant-a"))
    assert run_prompt(m, req("b", range(10), scope="tenant-b")) == 0
    assert run_prompt(m, req("c", range(10), scope="tenant-a")) == 8


def test_hit_is_confirmed_against_stored_tokens():
    m = mgr()
    a = req("a", range(10))
    run_prompt(m, a)
    # Forge a collision: another request's first key made equal to a's.
    b = req("b", range(50, 60))
    m.update_block_keys(b)
    b.block_keys[0] = a.block_keys[0]
    assert run_prompt(m, b) == 0


def test_freed_blocks_are_invalidated_and_evicted_keys_forgotten():
    m = mgr(num_blocks=4)  # 3 usable
    a = req("a", range(10))
    run_prompt(m, a)
    m.free(a)
    assert list(m.pool.free_queue) == [3, 2, 1]
    assert m.pool.blocks[3].state is BlockState.FREE  # partial: invalidated at once
    assert m.pool.blocks[2].state is BlockState.SEALED  # full: kept for hits
    b = req("b", range(100, 108))
    run_prompt(m, b)  # takes 3 and 2: evicts a's second block
    assert m.block_table(b) == [3, 2]
    assert a.block_keys[1] not in m.pool.cached
    assert m.pool.num_evictions == 1
    m.pool.check_invariants()


def test_reuse_without_invalidate_fault_leaves_a_stale_key():
    pool = BlockPool(4, faults=Faults(reuse_without_invalidate=True))
    m = KVCacheManager(pool, BS, weights_fingerprint="w", dtype="bf16")
    a = req("a", range(10))
    run_prompt(m, a)
    m.free(a)
    run_prompt(m, req("b", range(100, 108)))
    with pytest.raises(AssertionError, match="reused"):
        pool.check_invariants()


def test_key_encoding_is_typed_and_unambiguous():
    x = ExtraKeys("w", "bf16", None)
    assert block_key(None, [1, 2], x) != block_key(None, [1, 2], ExtraKeys("w", "bf16", ""))
    assert block_key(None, [1, 2], x) != block_key(None, [1, 2], ExtraKeys("w", "fp32", None))
    assert block_key(None, [1, 2], x) != block_key(None, [12], x)
    assert encode_str("ab") != encode_str("a") + encode_str("b")
    assert len(block_key(None, [1], x)) == 32
    assert len(weak(block_key(None, [1], x))) == 1
    assert coarse_block_key(None, 4, x) == coarse_block_key(None, 4, x)


def test_allocate_fails_cleanly_when_full():
    m = mgr(num_blocks=3)  # 2 usable
    a = req("a", range(8))
    assert m.allocate_slots(a, 0, 8)
    b = req("b", range(20, 24))
    assert not m.allocate_slots(b, 0, 4)
    assert m.block_table(b) == []
    m.pool.check_invariants()


def test_prefix_cache_statistics_count_admissions_not_retries(tiny_bundle):
    """A waiting request that finds no room is looked up again every step; the hit-rate counters
    must count it once, when it is admitted."""
    from isolab.sampling_params import SamplingParams
    from isolab.testing.workload import make_engine

    eng = make_engine(tiny_bundle, 4, max_seqs=8)
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("big", list(range(5, 65)), p)  # 60 + 4 tokens: exactly the 4 blocks
    eng.add_request("next", list(range(100, 116)), p)  # finds no free block until "big" ends
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert eng.scheduler.num_preemptions == 0
    assert steps >= 6, "next must have waited (been looked up) for several steps"
    assert eng.kv.num_query_tokens == 60 + 16
