"""Owns the RoPE tables: cos and sin of rotate-half RoPE for one base, (P, Dh) each, as the rope
kernel, the fused forward and the torch path read them.

The tables grow with the positions a forward asks for, not the model's whole context at load:
Gemma 3's 32,768 positions of 256 dimensions are 64 MiB of bf16 tables for its two bases, which an
idle server held for nothing.

Invariant: a position's row has the same bits whatever the table's size when it was built, so a
request's numbers do not depend on which requests came before it (or on the thread count). Rows
are computed in chunks of fixed shape (CHUNK_ELEMENTS at most, whole vectors): each chunk's cos
and sin run on one thread through torch's vector loop with no scalar tail, the same code for the
same element whatever else is computed; the multiply before them and the final rounding to the
model's dtype are exact IEEE operations.
"""

from __future__ import annotations

import threading

import torch

# At most ATen's grain size (32,768), so a chunk's cos/sin is never split between threads, and a
# multiple of 64 positions, so its element count is a multiple of every vector loop's step (2 x 16
# fp32 lanes on AVX-512): no element takes the scalar tail path.
CHUNK_ELEMENTS = 16384


class RopeTables:
    """cos/sin tables for one RoPE base, grown (by doubling, in whole chunks) up to `limit` positions."""

    def __init__(self, base: float, head_dim: int, limit: int, dtype: torch.dtype, device: torch.device) -> None:
        if head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head dimension, not {head_dim}")
        self.head_dim, self.dtype, self.device = head_dim, dtype, device
        half = head_dim // 2
        self.chunk = max(64, CHUNK_ELEMENTS // half // 64 * 64)  # positions a chunk
        self.limit = -(-max(limit, 1) // self.chunk) * self.chunk  # (whole chunks; rows past the context are unused)
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (Dh/2,)
        empty = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._tables: tuple[torch.Tensor, torch.Tensor] = (empty, empty)  # replaced whole, never edited: readers take one pair
        self._grow = threading.Lock()

    @property
    def rows(self) -> int:
        return self._tables[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tables)

    def _chunk(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + self.chunk, dtype=torch.float32)  # exact below 2^24
        freqs = torch.outer(pos, self.inv_freq)  # (C, Dh/2)
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat([cos, cos], dim=-1).to(self.device, self.dtype),  # (C, Dh)
                torch.cat([sin, sin], dim=-1).to(self.device, self.dtype))

    def upto(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (P, Dh) with P >= n (n is clipped to the limit): rows 0..P-1."""
        tables = self._tables
        if tables[0].shape[0] >= n:
            return tables
        with self._grow:
            cos, sin = self._tables
            have = cos.shape[0]
            if have >= n:
                return cos, sin
            want = min(self.limit, max(-(-n // self.chunk) * self.chunk, 2 * have))
            parts = [self._chunk(s) for s in range(have, want, self.chunk)]
            self._tables = (torch.cat([cos, *(c for c, _ in parts)]), torch.cat([sin, *(s for _, s in parts)]))
            return self._tables

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) covering every position in `positions` (N,) (no device sync once the tables are whole)."""
        tables = self._tables
        if tables[0].shape[0] >= self.limit or not positions.numel():
            return tables
        return self.upto(int(positions.max()) + 1)
