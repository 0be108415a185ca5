"""Audit mode's two storage-level protections, each with its off switch: freed blocks are filled
with NaN (so any stale read shows), and a sealed block's checksum is checked on the first read
by each reader (so contents changed behind the cache's back are named)."""

from __future__ import annotations

import pytest
import torch

from isolab.errors import IsolationViolation
from isolab.sampling_params import SamplingParams
from isolab.testing.workload import make_engine

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _finish(eng, rid: str, prompt: list[int]) -> list:
    eng.add_request(rid, prompt, GREEDY)
    outs = []
    while eng.has_unfinished():
        outs.extend(o for o in eng.step() if o.request_id == rid and o.finished)
    return outs


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("audit", [True, False])
def test_a_freed_unsealed_block_is_poisoned_only_in_audit_mode(tiny_bundle, audit, kv):
    """(int8 pool: its bytes all 0xFF, so its scales are NaNs: tests/kernels/test_kv_int8.py shows a read of one.)"""
    eng = make_engine(tiny_bundle, 8, audit=audit, kv_cache_dtype=kv)
    eng.add_request("a", list(range(5, 25)), GREEDY)  # 20 prompt tokens: one sealed block + a tail
    eng.step()
    tail = eng.kv.block_table(eng.requests["a"])[-1]
    while eng.has_unfinished():
        eng.step()
    assert eng.storage.has_nan(tail) is audit


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_sealed_block_changed_behind_the_caches_back_is_named(tiny_bundle, kv):
    eng = make_engine(tiny_bundle, 8, audit=True, kv_cache_dtype=kv)
    prompt = list(range(5, 40))  # two sealed blocks of 16, then a tail
    _finish(eng, "writer", prompt)
    sealed = [b for b in eng.pool.blocks if b.checksum is not None]
    assert sealed, "the writer must have sealed blocks"
    pool = eng.storage.layers[0]  # corrupt the K/V in place
    (pool[0, sealed[0].block_id] if kv == "int8" else pool[0, 0, sealed[0].block_id]).add_(torch.ones((), dtype=pool.dtype))
    outs = _finish(eng, "reader", prompt)
    assert outs and isinstance(outs[0].error, IsolationViolation)
    assert "contents changed" in str(outs[0].error)
