"""Owns isolab's quantized weight formats: GGUF blocks -> the records qgemm.cpp multiplies on, and
the torch reference that computes the same bits anywhere (a GPU, a machine without a compiler).

Two formats cover the GGUF types the shipped models use (qgemm.cpp states the arithmetic):
  u4  4-bit q in 0..15 with a scale and an offset per block of 32: w = d q + mn
      Q4_0 (mn = -8 d), Q4_1 (d, m), Q4_K (d = d_super sc_j, mn = -dmin m_j)
  s8  signed q with a scale per group of G k's: w = d q
      Q8_0 (G = 32), Q5_0 (q - 16, G = 32), Q6_K (q - 32, G = 16, d = d_super sc_j)
Scales stay fp16 where the GGUF's are fp16 (so a record is as small as the GGUF block); the
K-quants' products d * sc are exact in fp32, not in fp16, so they are kept as fp32.
Other types (F32, F16, BF16, Q5_1, Q5_K, ...) are not in this list: their layers run dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # k's per block
PANEL = 16  # columns per panel
U4, S8, S8G16 = 0, 1, 2  # qgemm.cpp: enum Fmt
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K")


@dataclass(frozen=True)
class Unpacked:
    """A quantized (N, K) weight as integers and scales: what the reference computes on and what
    the packer lays out. w[n, k] = d[n, g(k)] * q[n, k] (+ mn[n, k // 32] for u4)."""

    fmt: int  # U4, S8 or S8G16
    q: np.ndarray  # (N, K) uint8 (u4: 0..15) or int8
    d: np.ndarray  # (N, K // G) float16 or float32
    mn: np.ndarray | None  # (N, K // 32) like d; u4 only
    qtype: str  # the GGUF type it came from

    @property
    def group(self) -> int:
        return 16 if self.fmt == S8G16 else QK

    def dense(self) -> np.ndarray:
        """(N, K) float32 weights (w = d q + mn, computed in float64 and rounded once)."""
        d = np.repeat(self.d.astype(np.float64), self.group, axis=1)
        w = d * self.q.astype(np.float64)
        if self.mn is not None:
            w += np.repeat(self.mn.astype(np.float64), QK, axis=1)
        return w.astype(np.float32)


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1, block_bytes)  # (N, nblocks, bytes)


def _nibbles32(qs: np.ndarray) -> np.ndarray:  # (..., 16) bytes -> (..., 32): low nibbles, then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> Unpacked:
    """A GGUF tensor's bytes (N rows of blocks) -> integers and scales, exactly (no rounding)."""
    n, k = shape
    if qtype == "Q8_0":
        b = _blocks(raw, n, 34)
        return Unpacked(S8, b[..., 2:].view(np.int8).reshape(n, k), b[..., :2].copy().view(np.float16)[..., 0], None, qtype)
    if qtype == "Q4_0":
        b = _blocks(raw, n, 18)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        return Unpacked(U4, _nibbles32(b[..., 2:]).reshape(n, k), d, (d * np.float16(-8)).astype(np.float16), qtype)
    if qtype == "Q4_1":
        b = _blocks(raw, n, 20)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        return Unpacked(U4, _nibbles32(b[..., 4:]).reshape(n, k), d, m, qtype)
    if qtype == "Q5_0":
        b = _blocks(raw, n, 22)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        qh = b[..., 2:6].copy().view(np.uint32)  # (N, nb, 1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (N, nb, 32)
        q = (_nibbles32(b[..., 6:]) | (high << 4)).astype(np.int16) - 16
        return Unpacked(S8, q.astype(np.int8).reshape(n, k), d, None, qtype)
    if qtype == "Q4_K":
        from gguf.quants import Q4_K

        b = _blocks(raw, n, 144).reshape(-1, 144)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)  # (B, 1)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(b[:, 4:16])  # (B, 8) each, 6-bit
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k)
        return Unpacked(U4, q, (d * sc.astype(np.float32)).reshape(n, -1),
                        (-(dmin * m.astype(np.float32))).reshape(n, -1), qtype)
    if qtype == "Q6_K":
        b = _blocks(raw, n, 210).reshape(-1, 210)
        ql_all = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        lo6 = (ql_all & 0x0F).reshape(-1, 2, 128)
        qh_all = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        hi6 = (qh_all & 0x03).reshape(-1, 2, 128)
        q6 = ((lo6 | (hi6 << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)  # (B, 16)
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # (B, 1)
        return Unpacked(S8G16, q6, (d * sc).reshape(n, -1), None, qtype)
    raise ValueError(f"{qtype} is not a native quantized type ({', '.join(NATIVE_TYPES)})")


def record_bytes(fmt: int, fp16: bool) -> int:
    sb = 32 if fp16 else 64
    return 256 + 2 * sb if fmt == U4 else 512 + sb if fmt == S8 else 512 + 2 * sb


def pack(u: Unpacked) -> torch.Tensor:
    """-> uint8 (panels, K/32, record) as qgemm.cpp reads it; N padded to 16 with zero records.
    Each part is written once, straight into the records (a vocabulary head is 168M weights in
    Gemma 3: no temporaries of its size)."""
    return _pack(u, rows=False)


def pack_rows(u: Unpacked) -> torch.Tensor:
    """-> uint8 (panels, K/32, record) as qdense.cpp reads it (--weights dense on AMX): per panel of 16
    columns and block of 32 k's, each column's integers together (u4: byte i = q[i] | q[i + 16] << 4,
    the GGUF's own Q4 layout; s8: 32 int8), then the scales as pack lays them out. The same size as
    pack's records; N padded to 16 with zero records."""
    return _pack(u, rows=True)


def _pack(u: Unpacked, rows: bool) -> torch.Tensor:
    n, k = u.q.shape
    nb, p = k // QK, -(-n // PANEL)
    pad = p * PANEL - n

    def padded(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a

    fp16 = u.d.dtype == np.float16
    rec = np.empty((p, nb, record_bytes(u.fmt, fp16)), np.uint8)
    body_bytes = 256 if u.fmt == U4 else 512

    def part(start: int, shape: tuple[int, ...]) -> np.ndarray:  # a view of each record's bytes from start
        view = rec[..., start:start + int(np.prod(shape))].reshape(p, nb, *shape)
        assert np.may_share_memory(view, rec)  # a view, not a copy (writes must land in rec)
        return view

    q = padded(u.q)
    if rows:  # a column's 32 k's together (qdense.cpp)
        q = q.reshape(p, PANEL, nb, QK).transpose(0, 2, 1, 3)  # (panel, b, j, 32 k's)
        if u.fmt == U4:  # byte i: k's i (low nibble) and i + 16 (high)
            part(0, (PANEL, 16))[...] = q[..., :16] | (q[..., 16:] << 4)
        else:
            part(0, (PANEL, QK))[...] = q.view(np.uint8)
    elif u.fmt == U4:  # byte i of chunk c of column j: k's 8c + i (low nibble) and 8c + 4 + i (high)
        q = q.reshape(p, PANEL, nb, 4, 8)  # (panel, j, b, chunk, 8 k's)
        byte = q[..., :4] | (q[..., 4:] << 4)
        part(0, (4, PANEL, 4))[...] = byte.transpose(0, 2, 3, 1, 4)  # (panel, b, chunk, j, 4)
    else:  # q + 128 as a byte (two's complement: the sign bit flipped), 4 k's of one column together
        assert q.dtype == np.int8
        q = q.view(np.uint8).reshape(p, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # (panel, b, 8, j, 4 k's)
        np.bitwise_xor(q, np.uint8(0x80), out=part(0, (8, PANEL, 4)))
    groups = QK // u.group

    def scales(a: np.ndarray) -> np.ndarray:  # (N, nb * groups) -> (p, nb, groups * 16 * itemsize) bytes
        a = padded(a).reshape(p, PANEL, nb, groups).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(a).view(np.uint8).reshape(p, nb, -1)

    at = body_bytes
    for a in (u.d, *(() if u.mn is None else (u.mn.astype(u.d.dtype),))):
        b = scales(a)
        rec[..., at:at + b.shape[-1]] = b
        at += b.shape[-1]
    assert at == rec.shape[-1]
    return torch.from_numpy(rec)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, K) -> q (M, K/32, 32) float (exact integers), da (M, K/32), xs (M, K/32): qgemm.cpp's step 1."""
    m, k = x.shape
    xf = x.float().reshape(m, k // QK, QK)
    amax = xf.abs().amax(-1)
    # tensor / tensor: a correctly rounded division (torch's scalar / tensor is not, on CPU)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[..., None])
    da = amax / 127.0
    return q, da, da * q.sum(-1)


def qgemm_ref(x: torch.Tensor, u: TorchUnpacked, out_dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) @ W.T -> (M, N) in out_dtype: qgemm.cpp's definition in torch, the same bits."""
    q, da, xs = quantize_rows_ref(x)  # (M, nb, 32)
    m, nb, _ = q.shape
    g = u.group
    qa = q.reshape(m, nb * (QK // g), g).transpose(0, 1)  # (groups, M, g)
    isum = torch.bmm(qa, u.qf.transpose(1, 2))  # (groups, M, N): sums of exact integer products, exact
    acc = torch.zeros(m, u.n, dtype=torch.float32, device=x.device)
    per = QK // g
    for b in range(nb):
        for j in range(per):
            acc = acc + (u.d[:, b * per + j][None, :] * da[:, b][:, None]) * isum[b * per + j]
        if u.mn is not None:
            acc = acc + u.mn[:, b][None, :] * xs[:, b][:, None]
    return acc.to(out_dtype)


class TorchUnpacked:
    """An Unpacked weight as torch tensors on a device, for qgemm_ref."""

    def __init__(self, u: Unpacked, device: torch.device) -> None:
        self.n, k = u.q.shape
        self.group = u.group
        self.qf = torch.from_numpy(u.q.astype(np.float32)).to(device).reshape(self.n, k // u.group, u.group).transpose(0, 1).contiguous()  # (groups, N, g)
        self.d = torch.from_numpy(u.d.astype(np.float32)).to(device)
        self.mn = None if u.mn is None else torch.from_numpy(u.mn.astype(np.float32)).to(device)


def random_unpacked(fmt: int, n: int, k: int, fp16: bool, seed: int = 0) -> Unpacked:
    """A random weight in one format (the start-up check and the tests use it)."""
    rng = np.random.default_rng(seed)
    g = 16 if fmt == S8G16 else QK
    sdt = np.float16 if fp16 else np.float32
    if fmt == U4:
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        d = (rng.random((n, k // QK)) * 0.02 + 1e-3).astype(sdt)
        return Unpacked(U4, q, d, (-8 * d.astype(np.float32) * rng.random((n, k // QK))).astype(sdt), "random")
    lo = -32 if fmt == S8G16 else -127
    q = rng.integers(lo, -lo, (n, k), dtype=np.int16).astype(np.int8)
    return Unpacked(fmt, q, (rng.random((n, k // g)) * 0.004 + 1e-4).astype(sdt), None, "random")


def concat(parts: list[Unpacked]) -> Unpacked:
    """Weights stacked along N (q, k, v into one GEMM): one format, scales widened where they
    differ (fp16 -> fp32 and a group of 32 -> two of 16 are exact). Raises ValueError when u4
    meets s8."""
    fmts = {p.fmt for p in parts}
    if len(parts) == 1:
        return parts[0]
    if U4 in fmts and len(fmts) > 1:
        raise ValueError("u4 and s8 weights do not share a record format")
    fmt = S8G16 if S8G16 in fmts else fmts.pop()
    sdt = np.float16 if all(p.d.dtype == np.float16 for p in parts) else np.float32

    def d_of(p: Unpacked) -> np.ndarray:
        d = np.repeat(p.d, 2, axis=1) if fmt == S8G16 and p.fmt == S8 else p.d
        return d.astype(sdt)

    mn = np.concatenate([p.mn.astype(sdt) for p in parts]) if fmt == U4 else None  # type: ignore[union-attr]
    return Unpacked(fmt, np.concatenate([p.q for p in parts]), np.concatenate([d_of(p) for p in parts]), mn,
                    "+".join(sorted({p.qtype for p in parts})))


RECORD_FORMATS: dict[str, tuple[int, bool]] = {  # GGUF type -> (format, fp16 scales)
    "Q4_0": (U4, True), "Q4_1": (U4, True), "Q4_K": (U4, False),
    "Q8_0": (S8, True), "Q5_0": (S8, True), "Q6_K": (S8G16, False),
}
FORMAT_NAMES = {U4: "u4", S8: "s8", S8G16: "s8g16"}


def plan(qtypes: list[str]) -> list[tuple[int, bool, list[int]]]:
    """How weights of these GGUF types, stacked along N, run: [(format, fp16, indices of the parts)],
    one entry when they share a GEMM (as concat builds it), one per part when u4 meets s8."""
    fmts = [RECORD_FORMATS[q] for q in qtypes]
    kinds = {f for f, _ in fmts}
    if U4 in kinds and len(kinds) > 1:
        return [(f, h, [i]) for i, (f, h) in enumerate(fmts)]
    fmt = S8G16 if S8G16 in kinds else kinds.pop()
    return [(fmt, all(h for _, h in fmts), list(range(len(qtypes))))]


def format_label(fmt: int, fp16: bool) -> str:
    return f"{FORMAT_NAMES[fmt]}/{'fp16' if fp16 else 'fp32'}"


def dequantize_rows(packed: torch.Tensor, fmt: int, fp16: bool, ids: np.ndarray, k: int) -> np.ndarray:
    """Rows `ids` of a packed (N, K) weight as float32 (N, K): the values the GGUF's own
    dequantization gives (w = d q + mn with one rounding per operation, as gguf.quants does), read
    from the records, so a tied embedding table and its head are one copy."""
    nb, g = k // QK, (16 if fmt == S8G16 else QK)
    rec = packed.numpy()  # (panels, nb, record)
    p, j = ids // PANEL, ids % PANEL
    r = rec[p]  # (n, nb, record)
    sdt, sb = (np.float16, 32) if fp16 else (np.float32, 64)
    lane = j[:, None, None, None] * 4 + np.arange(4)[None, None, None, :]  # (n, 1, 1, 4) byte offsets in a chunk
    rows = np.arange(len(ids))[:, None, None, None]
    blocks = np.arange(nb)[None, :, None, None]
    if fmt == U4:
        chunk = np.arange(4)[None, None, :, None] * 64
        byte = r[rows, blocks, chunk + lane]  # (n, nb, 4 chunks, 4)
        q = np.concatenate([byte & 0x0F, byte >> 4], axis=-1).astype(np.float32)  # (n, nb, 4, 8): k = 8c + i
        scales = r[:, :, 256 : 256 + 2 * sb].copy().view(sdt).reshape(len(ids), nb, 2, PANEL)
        d = scales[np.arange(len(ids)), :, 0, j].astype(np.float32)[:, :, None, None]
        mn = scales[np.arange(len(ids)), :, 1, j].astype(np.float32)[:, :, None, None]
        return (d * q + mn).reshape(len(ids), k)
    chunk = np.arange(8)[None, None, :, None] * 64
    q = (r[rows, blocks, chunk + lane].astype(np.int16) - 128).astype(np.float32)  # (n, nb, 8, 4): k = 4c + i
    groups = QK // g
    scales = r[:, :, 512 : 512 + groups * sb].copy().view(sdt).reshape(len(ids), nb, groups, PANEL)
    d = scales[np.arange(len(ids)), :, :, j].astype(np.float32)  # (n, nb, groups)
    d = np.repeat(d, 8 // groups, axis=2)[:, :, :, None]  # per chunk
    return (d * q).reshape(len(ids), k)
