"""Owns what Gemma 3 changes in the Llama layer (models/llama.py holds the weights and the shared parts):

  embeddings scaled by sqrt(D), rounded to the dtype as transformers rounds them;
  RMSNorm as x * rsqrt(mean(x^2) + eps) * w in fp32, rounded once (the file's w is HF's 1 + w);
  norms before and after attention and after the MLP; a per-head RMSNorm of q and k;
  GELU-tanh; 5 of every 6 layers local: a sliding window (the paged kernel's `window`) and RoPE
  base 10,000, the others global (base from the file).

Every op is row-wise (the native kernels where they run), so a row's bits are its own.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from isolab import kernels
from isolab.models.rope import RopeTables


class GemmaModel(Protocol):
    """The parts of LlamaModel this forward reads (no import of models/llama.py: it calls us)."""

    hp: Any  # LlamaHParams with gemma=True
    layers: list[Any]  # Layer, with q_norm, k_norm, post_attn_norm, post_ffn_norm
    embed: Any  # (N,) ids -> (N, D)
    final_norm: torch.Tensor
    native_kernels: bool
    rope: RopeTables  # global layers
    rope_local: RopeTables  # local layers
    embed_scale: torch.Tensor  # sqrt(D) in the dtype

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim: (..., D) -> (..., D); weight fp32 (the file's 1 + w)."""
    if native:
        shape = x.shape
        return kernels.rms_norm_gemma(x.reshape(-1, shape[-1]).contiguous(), weight, eps).view(shape)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def forward(m: GemmaModel, token_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
    """token_ids, positions: (N,) -> final hidden states (N, D), normed. attn: an AttentionBackend."""
    hp = m.hp
    N = token_ids.shape[0]
    H, Hkv, Dh, eps, native = hp.num_heads, hp.num_kv_heads, hp.head_dim, hp.rms_eps, m.native_kernels
    x = m.embed[token_ids] * m.embed_scale  # (N, D)
    tables = {False: m.rope.for_positions(positions), True: m.rope_local.for_positions(positions)}  # (P, Dh) pairs
    for i, L in enumerate(m.layers):
        local = hp.is_local(i)
        cos, sin = tables[local]
        qkv = L.wqkv(norm(x, L.attn_norm, eps, native))  # (N, (H + 2 Hkv) Dh)
        q = norm(qkv[:, : H * Dh].reshape(N, H, Dh), L.q_norm, eps, native)
        k = norm(qkv[:, H * Dh : (H + Hkv) * Dh].reshape(N, Hkv, Dh), L.k_norm, eps, native)
        qkv = torch.cat([q.view(N, -1), k.view(N, -1), qkv[:, (H + Hkv) * Dh :]], dim=1)  # (N, W), normed
        if native:
            kernels.rope_(qkv, cos, sin, positions, H + Hkv, Dh)  # q and k in place
            qk = qkv[:, : (H + Hkv) * Dh].view(N, H + Hkv, Dh)
        else:
            qk = m._rope(qkv[:, : (H + Hkv) * Dh].view(N, H + Hkv, Dh), cos[positions].unsqueeze(1),
                         sin[positions].unsqueeze(1))
        v = qkv[:, (H + Hkv) * Dh :].view(N, Hkv, Dh)
        o = attn.attend(i, qk[:, :H], qk[:, H:], v, window=hp.sliding_window if local else 0)  # (N, H, Dh)
        x = x + norm(L.wo(o.reshape(N, H * Dh)), L.post_attn_norm, eps, native)
        gate, up = L.w_gate_up(norm(x, L.ffn_norm, eps, native)).chunk(2, dim=-1)
        x = x + norm(L.w_down(F.gelu(gate, approximate="tanh") * up), L.post_ffn_norm, eps, native)
    return norm(x, m.final_norm, eps, native)
