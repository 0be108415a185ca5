"""Owns how a model's layers split into KV cache groups: which layers share one block table, and
how far back each group's layers read (their sliding window, or everything).

Does not own blocks (block_pool.py, kv_cache_manager.py) nor tensors (kv_storage.py).

A model without local layers (Llama, Qwen), or the window cache switched off, has one group of all
layers: one block table a request, a block holds every layer's K/V (the engine as it always was).
Gemma 3 with the window cache splits into full-attention groups and sliding-window groups, as
vLLM's hybrid allocator does: every group holds the same number of layers, so a block is one
page size for all of them and one pool serves every group. Gemma 3 270M (18 layers, 5, 11 and
17 global): gcd(3, 15) = 3 layers a group:

    group 0  layers 5 11 17      window 0    keeps every block
    group 1  layers 0  1  2      window 512  frees blocks that left the window
    group 2  layers 3  4  6      window 512
    ...      (5 sliding groups in all; slot k of a group is its k-th layer)

A block id means a page of `len(group.layers)` layers; layer L's K/V live in the storage's slot
tensor k = its index in its group (kv_storage.KVStorage.layers[L] is that slot's tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from isolab.models.gguf_loader import LlamaHParams


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # model layers whose K/V this group's blocks hold; slot k holds layers[k]
    window: int  # 0: full attention, every block kept; > 0: each query reads its last `window` keys only


def kv_groups(hp: LlamaHParams, window_cache: bool = True) -> tuple[KVGroup, ...]:
    """The groups, full-attention ones first; one group of every layer without local layers or when
    window_cache is off."""
    local = [i for i in range(hp.num_layers) if hp.is_local(i)]
    full = [i for i in range(hp.num_layers) if not hp.is_local(i)]
    if not window_cache or not local:
        return (KVGroup(tuple(range(hp.num_layers)), 0),)
    size = math.gcd(len(local), len(full))  # gcd(n, 0) = n: a model of local layers only is one group
    return tuple(KVGroup(tuple(full[i : i + size]), 0) for i in range(0, len(full), size)) + tuple(
        KVGroup(tuple(local[i : i + size]), hp.sliding_window) for i in range(0, len(local), size)
    )


def first_needed_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a group still reads once num_computed_tokens are in the cache: the next query
    (position num_computed_tokens) reads keys from num_computed_tokens - window + 1 on.

        window 8, bs 4, 13 computed:  t0..t3 | t4..t7 | t8..t11 | t12 __ __ __
        the next query is position 13; it reads t6..t13: block 0 is never read again -> 1
    """
    if window <= 0:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size
