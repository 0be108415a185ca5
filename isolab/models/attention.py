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


def rope_tables(base: float, head_dim: int, positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Dh) cos and sin tables of rotate-half RoPE for a base, as the rope kernel and the torch path read them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)  # (P, Dh/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P, Dh)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


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
