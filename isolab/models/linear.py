"""Owns the linear layers' GEMM: one weight laid out for one GEMM path, x @ W.T.

The engine's isolation proof needs a row's bits to be the same whatever else is in the batch
(docs/engine.md, "Numerics"). Paths, in the order the engine prefers them
(isolab/models/invariance.py verifies the chosen one when the engine starts):

  isolab      isolab's own GEMM on packed panels (isolab/kernels/gemm.cpp): every output element
              is one fma chain over k in order, so it is invariant by construction, and the same
              bits on every ISA level. Needs the native kernels (a C++ compiler, a CPU device).
  onednn      oneDNN on a prepacked weight, a single row padded to two. Invariant on some CPUs
              (AVX-512 BF16 without AMX), not on others (AMX picks kernels by M): an observed
              property of one library, so it is used only where the check passes.
  fixed-tile  any torch GEMM called on blocks of exactly TILE rows (the last one padded): a row's
              bits can then depend only on its position inside a block, which the check measures.
              Costs up to TILE x the work at M = 1; a fallback for machines without a compiler.
  torch       F.linear as it comes: fast, invariant only where the library happens to be.
  split-k     FAULT batch-variant-gemm: F.linear whose reduction over K is split in two for
              M >= 8, as libraries do by heuristics. Exists to show the check catches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from isolab import kernels
from isolab.kernels import quant

GemmPath = Literal["isolab", "onednn", "fixed-tile", "torch", "split-k"]
GEMM_PATHS: tuple[GemmPath, ...] = ("isolab", "onednn", "fixed-tile", "torch")  # preference order
TILE = 32  # rows per call on the fixed-tile path
ONEDNN_BATCH_HINT = 32  # the layout oneDNN picks; any M runs on it, this one is tuned for decode


def onednn_can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def path_applies(path: GemmPath, device: torch.device, dtype: torch.dtype, native: bool) -> bool:
    """Whether `path` can run here at all (not whether it is invariant: the check says that)."""
    if path == "isolab":
        return native and device.type == "cpu"
    if path == "onednn":
        return onednn_can_pack(device, dtype)
    return True


class Weight:
    """A linear layer's (N, K) weight on one GEMM path: one copy, in that path's layout."""

    __slots__ = ("path", "n", "data")

    def __init__(self, weight: torch.Tensor, path: GemmPath = "torch") -> None:  # weight: (N, K)
        self.path: GemmPath = path
        self.n = weight.shape[0]
        if path == "isolab":
            self.data = kernels.pack_weight(weight)  # (N/16, K, 16) or (N/16, K/2, 16, 2) panels
        elif path == "onednn":
            self.data = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)  # oneDNN's blocked layout
        else:
            self.data = weight  # (N, K) as it came

    @classmethod
    def from_packed(cls, packed: torch.Tensor, n: int) -> Weight:
        """A weight on isolab's GEMM whose panels are packed already (kernels.pack_weight's layout;
        models/weight_cache.py maps them from a file)."""
        self = cls.__new__(cls)
        self.path, self.n, self.data = "isolab", n, packed
        return self

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM reads of this weight, in its path's layout."""
        return self.data.numel() * self.data.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T: (M, K) -> (M, N)."""
        if self.path == "isolab":
            return kernels.gemm(x if x.stride(1) == 1 else x.contiguous(), self.data, self.n)
        if self.path == "onednn":
            if x.shape[0] == 1:  # a single row takes another oneDNN kernel: pad it to two
                return self._onednn(x.expand(2, -1))[:1]
            return self._onednn(x)
        if self.path == "fixed-tile":
            return self._fixed_tile(x)
        if self.path == "split-k" and x.shape[0] >= 8:
            half = x.shape[1] // 2
            lo = F.linear(x[:, :half], self.data[:, :half]).float()
            return (lo + F.linear(x[:, half:], self.data[:, half:]).float()).to(x.dtype)
        return F.linear(x, self.data)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.data, None, "none", [], "")

    def _fixed_tile(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = -m % TILE
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return torch.cat([F.linear(x[s : s + TILE], self.data) for s in range(0, m + pad, TILE)])[:m]


class QuantWeight:
    """A linear layer's (N, K) weight kept in its GGUF block format (kernels/quant.py) and
    multiplied on the blocks: by qgemm.cpp where the native kernels run, else by the torch
    reference (a GPU, no compiler), which gives the same bits. Invariant by construction: the
    arithmetic of an output element is fixed by its row and the weight alone (qgemm.cpp)."""

    __slots__ = ("n", "fmt", "fp16", "qtype", "packed", "ref", "out_dtype", "big_batch", "_run")
    path = "quant"

    def __init__(self, u: quant.Unpacked, device: torch.device, native: bool,
                 out_dtype: torch.dtype | None = None, split_k: bool = False) -> None:
        """split_k: FAULT batch-variant-gemm (the quantized twin of the dense split-k path): from M >= 8
        rows a "faster path for big batches" multiplies dequantized weights instead, so a row's
        bits change with the batch."""
        self.n = u.q.shape[0]
        self.fmt = u.fmt
        self.fp16 = u.d.dtype == np.float16
        self.qtype = u.qtype  # what the GGUF stored, e.g. "Q4_1"
        self.packed = quant.pack(u) if native else None  # uint8 (N/16, K/32, record)
        self.ref = None if native else quant.TorchUnpacked(u, device)
        self.out_dtype = out_dtype  # None: the input's dtype
        self._run = (kernels.qgemm_bound(self.packed, u.fmt, self.fp16, self.n, out_dtype)
                     if self.packed is not None else None)
        # FAULT batch-variant-gemm: the dense (N, K) weights of the big-batch path
        self.big_batch = torch.from_numpy(u.dense()).to(device) if split_k else None

    @classmethod
    def from_records(cls, packed: torch.Tensor, n: int, fmt: int, fp16: bool, qtype: str,
                     out_dtype: torch.dtype | None = None) -> QuantWeight:
        """A weight whose records are packed already (models/weight_cache.py maps them from a
        file): the native kernels' path only, with the same arguments __init__ binds."""
        self = cls.__new__(cls)
        self.n, self.fmt, self.fp16, self.qtype = n, fmt, fp16, qtype
        self.packed, self.ref, self.out_dtype, self.big_batch = packed, None, out_dtype, None
        self._run = kernels.qgemm_bound(packed, fmt, fp16, n, out_dtype)
        return self

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel()
        assert self.ref is not None
        return sum(t.numel() * t.element_size() for t in (self.ref.qf, self.ref.d, self.ref.mn) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T: (M, K) -> (M, N)."""
        out = self.out_dtype or x.dtype
        if self.big_batch is not None and x.shape[0] >= 8:  # FAULT batch-variant-gemm
            return F.linear(x.float(), self.big_batch).to(out)
        if self._run is not None:
            return self._run(x if x.stride(1) == 1 else x.contiguous())
        assert self.ref is not None
        return quant.qgemm_ref(x, self.ref, out)


class BlockWeight:
    """A dense bf16 layer's weight kept in its GGUF blocks (kernels/qdense.cpp, records laid out by
    quant.pack_rows): each block is dequantized to bf16 right before the tile unit multiplies it,
    so the product is the dense isolab GEMM's on the weights `--weights dense` packs, bit for bit,
    read from 0.6 byte a weight (Q4_1) instead of 2. Where the tile unit runs (kernels.qdense_isa()
    == "amx"); elsewhere a dense model keeps its bf16 panels."""

    __slots__ = ("n", "fmt", "fp16", "qtype", "packed", "_run")
    path = "isolab"  # its numerics: the dense isolab GEMM's

    def __init__(self, packed: torch.Tensor, n: int, fmt: int, fp16: bool, qtype: str) -> None:
        self.n, self.fmt, self.fp16, self.qtype = n, fmt, fp16, qtype
        self.packed = packed  # uint8 (N/16, K/32, record): quant.pack_rows
        self._run = kernels.qdense_bound(packed, fmt, fp16, n)

    @classmethod
    def from_unpacked(cls, u: quant.Unpacked) -> BlockWeight:
        return cls(quant.pack_rows(u), u.q.shape[0], u.fmt, u.d.dtype == np.float16, u.qtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T: bf16 (M, K) -> bf16 (M, N)."""
        return self._run(x if x.stride(1) == 1 else x.contiguous())


class StackedWeight:
    """Weights whose formats cannot share one GEMM (u4 beside s8), run one after another and
    concatenated along N."""

    __slots__ = ("parts", "n")
    path = "quant"

    def __init__(self, parts: Sequence[Weight | QuantWeight | BlockWeight]) -> None:
        self.parts = parts
        self.n = sum(p.n for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=1)
