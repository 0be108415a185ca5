"""Owns the K/V tensors of the paged pool: one (2, Hkv, num_blocks, block_size, Dh) tensor per slot.

A slot is one layer of a KV cache group (kv_groups.py): with one group (no window cache) a slot per
layer, as always; with several, every group's k-th layer shares slot k, since a block is held by
one group at a time. `layers[L]` is layer L's slot tensor.

Head-major: each (head, block) is one contiguous run of block_size * Dh values, laid out inside
for whichever attention reads it (models/attention.py:write_kv: the native kernel's dot products, or
plain (block_size, Dh) for the torch path, which gathers whole runs with one index_select).

With kv_cache_dtype "int8" a slot is one int8 tensor (Hkv, num_blocks, bs / 16, 2, 16 * (Dh + 4)):
per KV head and 16-key run, the K run then the V run, int8 values and one fp32 scale a key
(models/attention.py:i8_pool_shape), 0.53x the bytes of bf16 in SmolLM2's shape. A block is then
`slot[:, block_id]`; poisoning fills its bytes with 0xFF, which makes every scale a NaN.

Sized from a memory budget; knows nothing of owners. Implements BlockStorage for the pool.
"""

from __future__ import annotations

import hashlib
import math
import mmap

import numpy as np
import torch

from isolab.engine.kv_groups import KVGroup
from isolab.errors import InvalidRequestError
from isolab.models.attention import i8_pool_shape
from isolab.models.gguf_loader import LlamaHParams


def bytes_per_block(hp: LlamaHParams, block_size: int, dtype: torch.dtype, layers_per_block: int | None = None) -> int:
    """A block's K/V bytes: `layers_per_block` layers (a KV group's size; None: every layer). dtype
    int8: the 8-bit pool's (a value a byte, plus an fp32 scale a key and head)."""
    layers = hp.num_layers if layers_per_block is None else layers_per_block
    if dtype == torch.int8:
        return layers * math.prod(i8_pool_shape(hp.num_kv_heads, 1, block_size, hp.head_dim))
    elem = torch.empty(0, dtype=dtype).element_size()
    return layers * 2 * block_size * hp.num_kv_heads * hp.head_dim * elem


def kv_cache_memory_for(hp: LlamaHParams, block_size: int, dtype: torch.dtype, usable_blocks: int,
                        layers_per_block: int | None = None) -> int:
    """The kv_cache_memory that gives a pool of exactly `usable_blocks` blocks requests can hold:
    the pool keeps one block more, the null block (block_pool.py), that no request ever holds."""
    return bytes_per_block(hp, block_size, dtype, layers_per_block) * (usable_blocks + 1)


class KVStorage:
    def __init__(self, hp: LlamaHParams, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 groups: tuple[KVGroup, ...] | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        groups = groups or (KVGroup(tuple(range(hp.num_layers)), 0),)
        size = len(groups[0].layers)
        assert all(len(g.layers) == size for g in groups), "every group holds the same number of layers"
        self.int8 = dtype == torch.int8  # the 8-bit pool: one tensor a slot, blocks along dim 1
        # per slot: [0] = K, [1] = V; (2, Hkv, num_blocks, block_size, Dh). Zeros: padding reads stay finite.
        shape = (i8_pool_shape(hp.num_kv_heads, num_blocks, block_size, hp.head_dim) if self.int8
                 else (2, hp.num_kv_heads, num_blocks, block_size, hp.head_dim))
        self.slots = [_zeros(shape, dtype, device) for _ in range(size)]
        slot_of = {layer: k for g in groups for k, layer in enumerate(g.layers)}
        self.layers = [self.slots[slot_of[i]] for i in range(hp.num_layers)]
        self._pointers = None  # (k, v) C arrays of the layers' pools, for the one-call forward

    def pool_pointers(self):
        """The layers' K and V pools as two C pointer arrays (kernels.forward_layers); built once."""
        if self._pointers is None:
            from isolab import kernels

            if self.int8:  # the int8 pool is one tensor: K pointers only (kernels.forward_layers' kv_i8)
                self._pointers = (kernels.pointer_array(self.layers), kernels.pointer_array(self.layers))
            else:
                self._pointers = (kernels.pointer_array([kv[0] for kv in self.layers]),
                                  kernels.pointer_array([kv[1] for kv in self.layers]))
        return self._pointers

    def _block(self, kv: torch.Tensor, block_id: int) -> torch.Tensor:
        return kv[:, block_id] if self.int8 else kv[:, :, block_id]

    def clear(self, block_id: int) -> None:
        for kv in self.slots:
            self._block(kv, block_id).zero_()

    def poison(self, block_id: int) -> None:
        for kv in self.slots:
            # int8: every byte 0xFF, so every scale is a NaN (and every value -1)
            self._block(kv, block_id).fill_(-1 if self.int8 else float("nan"))

    def checksum(self, block_id: int) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        for kv in self.slots:
            digest.update(self._block(kv, block_id).contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return digest.digest()

    def has_nan(self, block_id: int) -> bool:
        if self.int8:  # the scales: the last 4 * 16 bytes of each run
            return any(bool(torch.isnan(kv[:, block_id, :, :, -64:].contiguous().view(torch.float32)).any())
                       for kv in self.slots)
        return any(bool(torch.isnan(kv[:, :, block_id]).any()) for kv in self.slots)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost no memory until written, on the CPU: an anonymous mapping's pages are mapped
    (zeroed) by the OS on first touch, where torch.zeros writes every byte at once; so an idle
    server's RSS does not grow with kv_cache_memory.

    In 4 KiB pages, not huge ones: a layer's pool is 2 x Hkv runs of num_blocks blocks, and the first
    blocks a batch writes land in every run, so with 2 MiB pages (numpy's zeros asks for them) a fresh
    engine's first steps zeroed 2 MiB for every 2 KiB written: 0.7 s of a cold 32-request bench,
    slow steps later, and RSS for blocks nobody wrote (bench/first_touch.py)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    try:
        pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as exc:  # ENOMEM: more than the OS will map; Overflow: past a size_t
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "more than an address can hold"
        raise InvalidRequestError(f"the KV pool cannot be mapped (a layer's share alone is {nbytes / 2**30:,.1f} GiB: "
                                  f"{why}); give a smaller kv_cache_memory",
                                  field="kv_cache_memory") from None
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where transparent huge pages are "always"
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    # numpy's array holds the mapping, the tensor holds the array: the pages live as long as the tensor
    return torch.from_numpy(np.frombuffer(pages, dtype=np.uint8, count=nbytes)).view(dtype).view(shape)
