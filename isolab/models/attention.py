"""Owns attention over K/V in torch, and the K/V block layouts the paged pool and the kernel share.

`attention_core` is the one torch attention both the reference and the engine's torch path run;
`write_kv`/`gather_kv` put K/V into and out of one layer's pool (2, Hkv, num_blocks, bs, Dh) in
the layout isolab's paged-attention kernel reads (isolab/kernels/paged_attention.cpp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_PAD = 16  # attention always sees a multiple of 16 keys (see attention_core)


def causal_hidden(q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(B, T) positions -> (B, T, S) bool, True where key j is a later position than the query."""
    key_pos = torch.arange(num_keys, device=q_pos.device)
    return key_pos.view(1, 1, num_keys) > q_pos.unsqueeze(-1)


def attention_core(
    q: torch.Tensor,  # (B, T, H, Dh) queries, padded rows allowed
    k: torch.Tensor,  # (Hkv, B, S, Dh) keys at positions 0..S-1, padded keys allowed
    v: torch.Tensor,  # (Hkv, B, S, Dh)
    q_pos: torch.Tensor,  # (B, T) absolute position of each query; key j is visible iff j <= q_pos
    scale: float,
    hidden: torch.Tensor | None = None,  # (B, T, S) precomputed causal_hidden(q_pos, S), optional
    window: int = 0,  # > 0: a query also does not see keys window or more positions back (sliding window)
) -> torch.Tensor:  # (B, T, H, Dh)
    B, T, H, Dh = q.shape
    Hkv, S = k.shape[0], k.shape[2]
    if S % KEY_PAD:
        # bf16 GEMM rounds differently when the key count is not a multiple of 16; the paged
        # pool always hands over whole blocks, so pad here too and every caller agrees.
        pad = KEY_PAD - S % KEY_PAD
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
        S += pad
        hidden = None
    G = H // Hkv
    # Grouped-query attention without copying K/V: fold each KV head's G query heads into rows.
    qg = q.view(B, T, Hkv, G, Dh).permute(2, 0, 3, 1, 4).reshape(Hkv, B, G * T, Dh)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(scale).view(Hkv, B, G, T, S)
    if hidden is None:
        hidden = causal_hidden(q_pos, S)
    # The causal mask is an isolation boundary (claim C9): no query sees a later position.
    if window > 0:
        hidden = hidden | (torch.arange(S, device=q_pos.device).view(1, 1, S) <= q_pos.unsqueeze(-1) - window)
    scores.masked_fill_(hidden.view(1, B, 1, T, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(Hkv, B, G * T, S)
    out = torch.matmul(probs, v)  # (Hkv, B, G*T, Dh)
    return out.view(Hkv, B, G, T, Dh).permute(1, 3, 0, 2, 4).reshape(B, T, H, Dh)


def write_kv(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, native: bool = True) -> None:
    """Store k, v (N, Hkv, Dh) at flat slots (N,) of one layer's pool (2, Hkv, num_blocks, bs, Dh).

    native: each block holds bs * Dh values laid out for the native kernel's dot products (the
    layout the kernel itself writes, isolab/kernels/paged_attention.cpp):
      fp32: K block (Dh, bs), so 16 keys of one dimension are one vector; V block (bs, Dh)
      bf16: K block (Dh/2, bs, 2) and V block (bs/2, Dh, 2): the pairs one AVX512-BF16 dot
            product takes (two dimensions of one key; one dimension of two keys) side by side
      a block of bs = 16 f keys (f > 1) holds f runs of 16 keys, each laid out as a block of 16
      (the kernel reads them as 16-key blocks: key_run); V's layout is that already
    not native (the torch path): K and V blocks both (bs, Dh), what attention_core reads.
    """
    _, hkv, nb, bs, dh = kv.shape
    if not native:
        flat = kv.view(2, hkv, nb * bs, dh)
        flat[0].index_copy_(1, slots, k.transpose(0, 1))
        flat[1].index_copy_(1, slots, v.transpose(0, 1))
        return
    r = key_run(bs)
    run, off = slots // r, slots % r  # the slot's run of r keys in the layer, its place in the run
    if kv.dtype == torch.bfloat16:
        kv[0].view(hkv, nb * bs // r, dh // 2, r, 2)[:, run, :, off, :] = k.view(-1, hkv, dh // 2, 2)  # [h, run, d/2, o, d%2]
        blk, o = slots // bs, slots % bs
        kv[1].view(hkv, nb, bs // 2, dh, 2)[:, blk, o // 2, :, o % 2] = v  # [h, b, o/2, d, o%2]
    else:
        kv[0].view(hkv, nb * bs // r, dh, r)[:, run, :, off] = k  # [h, run, d, o]
        kv[1].view(hkv, nb * bs, dh).index_copy_(1, slots, v.transpose(0, 1))


# ---- the 8-bit pool (kv_cache_dtype "int8"; paged_attention.cpp's attend_all_i8 reads it) ----
# One layer's pool: (Hkv, num_blocks, bs / 16, 2, 16 * (Dh + 4)) int8: per KV head and 16-key run
# of a block, the K run then the V run, each 16 * Dh int8 values in the bf16 pool's order (K
# (Dh/2, 16, 2), V (8, Dh, 2)) followed by the 16 keys' fp32 scales.
I8_RUN = 16


def i8_pool_shape(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size // I8_RUN, 2, I8_RUN * (head_dim + 4))


def quantize_keys_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., Dh) -> int8 values (..., Dh) and fp32 scales (...): s = max|x| / 127, q = round-half-even(x / s),
    the kernel's rule (quantize_key_i8): a NaN or infinity among x makes s the quiet NaN (every q 0),
    s = 0 makes every q 0."""
    xf = x.float()
    s = xf.abs().amax(-1) / 127.0
    s = torch.where(torch.isfinite(s) & ~xf.isnan().any(-1), s, torch.full_like(s, float("nan")))
    ok = (s > 0).unsqueeze(-1)
    q = torch.where(ok, torch.round(xf / torch.where(ok, s.unsqueeze(-1), torch.ones_like(s).unsqueeze(-1))), 0.0)
    return q.clamp(-127, 127).to(torch.int8), s


def _i8_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K values (Hkv, R, Dh/2, 16, 2), K scales (Hkv, R, 16), V values (Hkv, R, 8, Dh, 2), V scales of the
    int8 pool's R = num_blocks * bs / 16 runs: views, written through."""
    hkv, nb, f, _, rb = kv.shape
    dh = rb // I8_RUN - 4
    runs = kv.view(hkv, nb * f, 2, rb)
    k, v = runs[:, :, 0], runs[:, :, 1]
    return (k[..., :I8_RUN * dh].view(hkv, nb * f, dh // 2, I8_RUN, 2), k[..., I8_RUN * dh:].view(torch.float32),
            v[..., :I8_RUN * dh].view(hkv, nb * f, I8_RUN // 2, dh, 2), v[..., I8_RUN * dh:].view(torch.float32))


def write_kv_i8(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v (N, Hkv, Dh) at flat slots (N,) of one layer's int8 pool: the bytes the kernel writes."""
    kq, ks = quantize_keys_i8(k)
    vq, vs = quantize_keys_i8(v)
    kvals, kscale, vvals, vscale = _i8_views(kv)
    run, off = slots // I8_RUN, slots % I8_RUN
    kvals[:, run, :, off, :] = kq.view(kq.shape[0], kq.shape[1], -1, 2)  # [n, h, d/2, d%2]
    kscale[:, run, off] = ks.transpose(0, 1)
    vvals[:, run, off // 2, :, off % 2] = vq  # [n, h, d]
    vscale[:, run, off] = vs.transpose(0, 1)


def gather_kv_i8(kv: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks (B, nb) of the int8 pool -> K, V (Hkv, B, nb * bs, Dh) dequantized (scale * q in fp32) to dtype."""
    hkv, _, f, _, rb = kv.shape
    dh = rb // I8_RUN - 4
    b, nb = blocks.shape
    runs = (blocks.view(-1, 1) * f + torch.arange(f, device=blocks.device)).view(-1)  # (B * nb * f,)
    kvals, kscale, vvals, vscale = _i8_views(kv)
    kq = kvals[:, runs].permute(0, 1, 3, 2, 4).reshape(hkv, -1, I8_RUN, dh)  # (Hkv, runs, 16, Dh)
    vq = vvals[:, runs].permute(0, 1, 2, 4, 3).reshape(hkv, -1, I8_RUN, dh)
    k = kq.float() * kscale[:, runs].unsqueeze(-1)
    v = vq.float() * vscale[:, runs].unsqueeze(-1)
    return k.to(dtype).reshape(hkv, b, nb * f * I8_RUN, dh), v.to(dtype).reshape(hkv, b, nb * f * I8_RUN, dh)


def key_run(bs: int) -> int:
    """Keys a native K run holds: 16 where the block size is a multiple of 16, so that every such
    block size takes the attention kernel's fast paths with the bits of 16 (paged_attention.cpp);
    else the whole block."""
    return 16 if bs % 16 == 0 else bs


def gather_kv(kv: torch.Tensor, rows: torch.Tensor, batch: int, *, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Read whole (block, head) runs of kv (2, Hkv, num_blocks, bs, Dh), in the order of `rows`
    (2 * Hkv * B * nb,) as (kv, head, row, table entry) -> K, V (Hkv, B, nb * bs, Dh).

    One index_select along dim 0 of a contiguous view (measured 1.6x faster than two along the
    block dim). The torch path's pool (native=False) is already (bs, Dh); a native pool's blocks
    are put back from write_kv's layout (tests compare the kernel with attention_core this way)."""
    _, hkv, num_blocks, bs, dh = kv.shape
    got = kv.view(2 * hkv * num_blocks, bs * dh).index_select(0, rows).view(2, hkv, batch, -1, bs * dh)
    nb = got.shape[3]
    if not native:
        return got[0].view(hkv, batch, nb * bs, dh), got[1].view(hkv, batch, nb * bs, dh)
    runs = nb * bs // key_run(bs)
    if kv.dtype == torch.bfloat16:
        k = got[0].view(hkv, batch, runs, dh // 2, key_run(bs), 2).permute(0, 1, 2, 4, 3, 5)  # -> (.., r, d/2, 2)
        v = got[1].view(hkv, batch, nb, bs // 2, dh, 2).permute(0, 1, 2, 3, 5, 4)  # -> (.., o/2, 2, dh)
    else:
        k = got[0].view(hkv, batch, runs, dh, key_run(bs)).transpose(-1, -2)
        v = got[1]
    return k.reshape(hkv, batch, nb * bs, dh), v.reshape(hkv, batch, nb * bs, dh)
