"""The sliding-window-aware KV cache (engine/kv_groups.py): Gemma 3's local layers keep only the
blocks their window still reads, bit for bit what the full cache computes.

On a tiny Gemma 3 (6 layers: 5 local with a 24-token window, 1 global) with 4-token blocks, so a
150-token prompt is six windows long."""

from __future__ import annotations

import random

import pytest

from isolab.engine.block_pool import BlockPool
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.kv_groups import KVGroup, first_needed_block, kv_groups
from isolab.engine.request import Request
from isolab.errors import IsolationViolation
from isolab.sampling_params import SamplingParams
from isolab.testing.workload import Arrival, drive, make_engine

W, BS, BUDGET = 24, 4, 32


@pytest.fixture(scope="module")
def gemma_bundle(tmp_path_factory):
    from isolab.models.bundle import load_bundle
    from isolab.testing.tiny_model import TinySpec, write_tiny_llama

    spec = TinySpec(layers=6, seed=1, arch="gemma3", sliding_window=W, context=1024)
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-gemma.gguf", spec)
    return load_bundle(str(path), "bf16", "cpu")


def _engine(bundle, *, window_cache=True, prefix=True, audit=False, kv_blocks=2000):
    from dataclasses import replace

    eng = make_engine(bundle, kv_blocks, block_size=BS, prefix=prefix, budget=BUDGET, audit=audit)
    if not window_cache:  # the same pool memory, every layer keeping every block
        from isolab.engine.llm_engine import LLMEngine

        cfg = eng.config
        eng = LLMEngine(replace(cfg, cache=replace(cfg.cache, window_cache=False)), bundle)
    return eng


def _prompt(bundle, n, seed=0):
    rng = random.Random(seed)
    return tuple(rng.randrange(100, bundle.hparams.vocab_size) for _ in range(n))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)


def test_groups_split_local_and_global_layers(gemma_bundle, tiny_bundle):
    hp = gemma_bundle.hparams
    assert kv_groups(hp) == (KVGroup((5,), 0),) + tuple(KVGroup((i,), W) for i in range(5))
    assert kv_groups(hp, window_cache=False) == (KVGroup(tuple(range(6)), 0),)
    assert kv_groups(tiny_bundle.hparams) == (KVGroup((0, 1), 0),)  # Llama: one group, as always


def test_first_needed_block_arithmetic():
    # window 8, bs 4: the next query at position p reads p - 7 .. p
    assert [first_needed_block(p, 8, 4) for p in (0, 7, 8, 10, 11, 12, 13)] == [0, 0, 0, 0, 1, 1, 1]
    assert first_needed_block(1000, 0, 4) == 0  # full attention keeps everything


@pytest.fixture(scope="module")
def gemma_torch_path(gemma_bundle):
    """The same model on the torch path (no native kernels): gathers and a masked attention_core."""
    import dataclasses

    from isolab.models.gguf_loader import load_gguf
    from isolab.models.llama import LlamaModel

    model = LlamaModel(load_gguf(str(gemma_bundle.path)), "bf16", "cpu", native=False)
    return dataclasses.replace(gemma_bundle, model=model)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_logits_equal_the_full_cache_past_the_window(gemma_bundle, gemma_torch_path, path):
    """(1) a 150-token prompt (six windows), chunked, then decode: tokens and top-5 logprobs bit for bit."""
    if path == "torch":
        gemma_bundle = gemma_torch_path
    assert gemma_bundle.model.native_kernels == (path == "native")
    arrivals = [Arrival(0, "long", _prompt(gemma_bundle, 150), GREEDY),
                Arrival(3, "other", _prompt(gemma_bundle, 70, seed=1), GREEDY)]
    with_window = drive(_engine(gemma_bundle), arrivals, check_invariants=True).finished
    without = drive(_engine(gemma_bundle, window_cache=False), arrivals).finished
    for rid in ("long", "other"):
        assert with_window[rid].token_ids == without[rid].token_ids
        assert with_window[rid].logprobs == without[rid].logprobs  # TokenLogprob: value and top-5, exact


def test_local_blocks_stay_bounded_while_global_grows(gemma_bundle):
    """(2) per step, each local group holds at most the window plus one chunk; in decode W/bs + 2."""
    eng = _engine(gemma_bundle)
    eng.add_request("r", list(_prompt(gemma_bundle, 150)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    peak_local, decode_local, held_global = 0, 0, []
    while eng.has_unfinished():
        eng.step()
        req = eng.requests.get("r")
        if req is None:
            break
        held = eng.kv.num_held_blocks_by_group()
        held_global.append(held[0])
        assert len(set(held[1:])) == 1  # every local group alike
        peak_local = max(peak_local, held[1])
        if req.num_computed_tokens > 150:
            decode_local = max(decode_local, held[1])
        eng.pool.check_invariants()
    assert peak_local <= (W - 1 + BUDGET) // BS + 2
    assert decode_local <= W // BS + 2
    assert held_global[-1] == -(-179 // BS)  # the global group keeps every block: 150 + 29 tokens
    assert eng.kv.num_held_blocks() == 0


def test_prefix_hit_equals_miss_past_the_window(gemma_bundle):
    """(3) a 120-token shared prefix: the hit restores the global blocks and the local windows only."""
    p = _prompt(gemma_bundle, 120)
    first = Arrival(0, "first", p + _prompt(gemma_bundle, 9, seed=2), GREEDY)
    second = Arrival(0, "second", p + _prompt(gemma_bundle, 13, seed=3), GREEDY)
    eng = _engine(gemma_bundle)
    drive(eng, [first])
    warm = drive(eng, [second]).finished["second"]
    assert warm.num_cached_tokens == 120
    cold = drive(_engine(gemma_bundle, prefix=False), [second]).finished["second"]
    assert cold.num_cached_tokens == 0
    assert (warm.token_ids, warm.logprobs) == (cold.token_ids, cold.logprobs)


def test_audit_is_clean_and_a_freed_local_block_in_the_window_is_caught(gemma_bundle, monkeypatch):
    """(4) audit mode stays silent on the window cache; freeing one block too early (an off-by-one
    in the window arithmetic) makes a local layer read a released entry: the audit names it, and
    without audit the output is wrong."""
    arrivals = [Arrival(0, "long", _prompt(gemma_bundle, 150), GREEDY)]
    healthy = drive(_engine(gemma_bundle, audit=True), arrivals, check_invariants=True)
    assert healthy.errors() == [] and healthy.invariant_breach is None
    import isolab.engine.kv_cache_manager as kvm

    monkeypatch.setattr(kvm, "first_needed_block", lambda n, w, bs: first_needed_block(n, w, bs) + (1 if w else 0))
    caught = drive(_engine(gemma_bundle, audit=True), arrivals).errors()
    assert caught and isinstance(caught[0][1], IsolationViolation)
    assert "in the window" in str(caught[0][1])
    wrong = drive(_engine(gemma_bundle), arrivals).finished["long"]
    assert wrong.logprobs != healthy.finished["long"].logprobs


# -- the cache manager alone, exact ids (window 8, blocks of 4) --------------------------------------

def _mgr(num_blocks=40):
    return KVCacheManager(BlockPool(num_blocks), 4, weights_fingerprint="w", dtype="bf16", windows=(0, 8))


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), None)


def _step(m, r, start, n, prefix=None):
    from isolab.engine.kv_cache_manager import NO_PREFIX

    assert m.allocate_slots(r, start, n, prefix or NO_PREFIX)
    m.commit(r, start, n)


def test_manager_frees_window_blocks_and_hits_need_only_the_window():
    m = _mgr()
    a = _req("a", range(10, 27))  # 17 tokens
    _step(m, a, 0, 8)
    _step(m, a, 8, 8)
    assert m.block_table(a, group=0) == [1, 2, 5, 6] and m.block_table(a, group=1) == [3, 4, 7, 8]
    _step(m, a, 16, 1)  # the query at 16 reads 9..16: the window group's blocks 0 and 1 are released
    assert m.block_table(a, group=0) == [1, 2, 5, 6, 9] and m.block_table(a, group=1) == [0, 0, 7, 8, 10]
    assert m.num_held_blocks_by_group() == [5, 3]
    assert list(m.pool.free_queue)[-2:] == [3, 4]  # released oldest first: evicted first
    m.free(a)
    # the same 16 tokens + 2: a hit of 16 tokens needs global blocks 0..3 and window blocks 2..3 only
    b = _req("b", list(range(10, 26)) + [99, 98])
    prefix = m.get_computed_blocks(b)
    assert prefix.num_tokens == 16 and prefix.starts == (0, 2)
    _step(m, b, 16, 2, prefix)
    assert m.block_table(b, group=0)[:4] == [1, 2, 5, 6] and m.block_table(b, group=1)[:4] == [0, 0, 7, 8]
    m.free(b)
    m.pool.check_invariants()


def test_manager_hit_is_shorter_when_a_window_block_was_evicted():
    m = _mgr(num_blocks=12)
    a = _req("a", range(10, 27))
    _step(m, a, 0, 16)
    _step(m, a, 16, 1)
    m.free(a)
    window_block = m.pool.lookup(m.keys.group_key(a.block_keys[3], 1))
    assert window_block is not None
    # take every free block but one: the queue's front goes first, and the window group's block 3 of
    # "a" was released before "a"'s global tail; evict exactly it by draining up to it
    order = list(m.pool.free_queue)
    taken = m.pool.allocate(order.index(window_block.block_id) + 1, "x", None)
    assert m.pool.lookup(m.keys.group_key(a.block_keys[3], 1)) is None
    b = _req("b", list(range(10, 26)) + [99])
    prefix = m.get_computed_blocks(b)
    assert prefix.num_tokens < 16  # block 3's window copy is gone: the hit stops before it
    m.pool.release(taken, "x")
    m.pool.check_invariants()


CACHE_FAULTS = ("reuse-without-invalidate", "coarse-key", "weak-hash", "no-scope", "write-shared")


@pytest.mark.parametrize("fault", CACHE_FAULTS)
def test_the_cache_faults_are_caught_on_the_window_cache(gemma_bundle, fault):
    """The catalogue's cache faults reach every KV group: each scenario stays silent on the healthy
    tiny Gemma 3 (six groups) and is caught with its fault on."""
    from isolab.engine.selftest import SCENARIOS, run_scenario

    sc = next(s for s in SCENARIOS if s.fault == fault)
    assert not run_scenario(gemma_bundle, sc).caught
    assert run_scenario(gemma_bundle, sc, frozenset([fault])).caught


def test_every_groups_hits_leave_the_free_queue_before_any_allocation():
    """Regression (found by the window state machine): group 0's allocation popped group 1's idle
    hit off the free queue, so one block was a hit and a new block at once (2 holders, ALLOCATED)."""
    m = _mgr(num_blocks=7)
    a = _req("a", range(10, 18))  # 8 tokens: group 0 blocks [1, 2], group 1 [3, 4], all sealed
    _step(m, a, 0, 8)
    spare = m.pool.allocate(2, "x", None)  # 5, 6
    m.free(a)
    m.pool.release(spare, "x")
    assert list(m.pool.free_queue) == [2, 4, 1, 3, 5, 6]  # tail position first, across the groups
    b = _req("b", list(range(10, 18)) + [99])
    prefix = m.get_computed_blocks(b)
    assert prefix.num_tokens == 8
    _step(m, b, 8, 1, prefix)
    assert m.block_table(b, group=0) == [1, 2, 5] and m.block_table(b, group=1) == [3, 4, 6]
    m.pool.check_invariants()


def test_a_block_key_that_forgets_its_group_is_caught_by_the_audit(gemma_bundle, monkeypatch):
    """Group g's blocks are keyed apart from group 0's (hashing.group_block_key). If the key forgot
    the group, a hit would hand a local layer the global layers' K/V for the same tokens: same
    scope, same tokens, an intact checksum. The audit checks each block's group and names it;
    without audit the output is wrong."""
    p = _prompt(gemma_bundle, 120)
    first = Arrival(0, "first", p + _prompt(gemma_bundle, 9, seed=2), GREEDY)
    second = Arrival(0, "second", p + _prompt(gemma_bundle, 13, seed=3), GREEDY)
    healthy = _engine(gemma_bundle, audit=True)
    drive(healthy, [first])
    assert drive(healthy, [second]).errors() == []
    cold = drive(_engine(gemma_bundle, prefix=False), [second]).finished["second"]
    from isolab.engine.hashing import KeyPolicy

    monkeypatch.setattr(KeyPolicy, "group_key", lambda self, key, group: key)  # the bug
    audited = _engine(gemma_bundle, audit=True)
    drive(audited, [first])
    caught = drive(audited, [second]).errors()
    assert caught and isinstance(caught[0][1], IsolationViolation) and "KV group" in str(caught[0][1])
    plain = _engine(gemma_bundle)
    drive(plain, [first])
    wrong = drive(plain, [second]).finished["second"]
    assert wrong.num_cached_tokens > 0 and wrong.logprobs != cold.logprobs
