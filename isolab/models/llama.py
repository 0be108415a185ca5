"""Owns the Llama forward pass in PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied head.

Does not own the KV cache: each layer hands its new K/V to an `AttentionBackend`, which stores
them wherever it keeps K/V (a dense tensor for the reference path, the paged pool for the
engine) and returns the attention output. `attention_core` is the one attention kernel both use,
so a paged run and the reference run do the same arithmetic.

Batch invariance (issue 3): in bf16 every op here gives a row the same bits whatever else is in
the batch: GEMMs on prepacked oneDNN weights keep one reduction order per row for any M (`Weight`
pads a single row), and softmax over keys masked with -inf is unchanged by padding. In fp32 the
GEMMs are invariant too, but attention's bmm (MKL) is not: see docs/engine.md, "Numerics".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from isolab import kernels
from isolab.models.gguf_loader import LlamaHParams, LoadedGGUF

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KEY_PAD = 16  # attention always sees a multiple of 16 keys (see attention_core)


class Weight:
    """A linear layer's (N, K) weight, prepacked for oneDNN where the device allows it.

    Measured on this CPU (bench/batch_invariance.py): oneDNN on a prepacked weight gives a row
    the same bits at every batch size M >= 2, in fp32 as in bf16, and at M = 32 runs 1.4x (bf16)
    to 1.6x (fp32) faster than F.linear, which repacks per call (bf16) or goes to MKL (fp32,
    whose bits change with M). A single row takes another kernel (for K = 1536 about 1 output in
    6,000 gets other bits), so it is padded to two. Without oneDNN (CUDA) it is the plain weight
    and F.linear.
    """

    __slots__ = ("packed", "plain")

    def __init__(self, weight: torch.Tensor) -> None:  # (N, K)
        self.packed: torch.Tensor | None = None  # oneDNN's blocked layout; replaces `plain`
        self.plain: torch.Tensor | None = weight
        if weight.device.type == "cpu" and _can_pack(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            self.plain = None  # one copy of the weights, not two

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T: (M, K) -> (M, N)."""
        if x.shape[0] == 1 and x.device.type == "cpu":
            return self._apply(x.expand(2, -1))[:1]
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        assert self.plain is not None
        return F.linear(x, self.plain)


PACK_BATCH_HINT = 32  # the layout oneDNN picks; any M runs on it, this one is tuned for decode


def _can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class Layer:
    attn_norm: torch.Tensor  # (D,)
    wqkv: Weight  # (H*Dh + 2*Hkv*Dh, D): q, k, v in one GEMM
    wo: Weight  # (D, H*Dh)
    ffn_norm: torch.Tensor  # (D,)
    w_gate_up: Weight  # (2I, D): gate and up in one GEMM
    w_down: Weight  # (D, I)


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v (N, Hkv, Dh) of this step's N tokens; return attention of q (N, H, Dh) -> (N, H, Dh)."""
        ...


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
    not native (the torch path): K and V blocks both (bs, Dh), what attention_core reads.
    """
    _, hkv, nb, bs, dh = kv.shape
    blk, off = slots // bs, slots % bs
    if not native:
        flat = kv.view(2, hkv, nb * bs, dh)
        flat[0].index_copy_(1, slots, k.transpose(0, 1))
        flat[1].index_copy_(1, slots, v.transpose(0, 1))
    elif kv.dtype == torch.bfloat16:
        kv[0].view(hkv, nb, dh // 2, bs, 2)[:, blk, :, off, :] = k.view(-1, hkv, dh // 2, 2)  # [h, b, d/2, o, d%2]
        kv[1].view(hkv, nb, bs // 2, dh, 2)[:, blk, off // 2, :, off % 2] = v  # [h, b, o/2, d, o%2]
    else:
        kv[0].view(hkv, nb, dh, bs)[:, blk, :, off] = k  # [h, b, d, o]
        kv[1].view(hkv, nb * bs, dh).index_copy_(1, slots, v.transpose(0, 1))


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
    if kv.dtype == torch.bfloat16:
        k = got[0].view(hkv, batch, nb, dh // 2, bs, 2).permute(0, 1, 2, 4, 3, 5)  # -> (.., bs, d/2, 2)
        v = got[1].view(hkv, batch, nb, bs // 2, dh, 2).permute(0, 1, 2, 3, 5, 4)  # -> (.., o/2, 2, dh)
    else:
        k = got[0].view(hkv, batch, nb, dh, bs).transpose(-1, -2)
        v = got[1]
    return k.reshape(hkv, batch, nb * bs, dh), v.reshape(hkv, batch, nb * bs, dh)


class DenseKV:
    """The reference backend: one sequence, no sharing at all.

    With the native kernel, K/V live in a private pool with the identity block table, so the
    reference does the same arithmetic as the engine; on the torch path, in growing contiguous
    tensors read by attention_core.
    """

    def __init__(self, hp: LlamaHParams, num_tokens: int, dtype: torch.dtype, device: torch.device, native: bool) -> None:
        self.native = native
        self.scale = hp.head_dim ** -0.5
        self.q_pos: torch.Tensor | None = None  # set by the caller before each forward
        self.k: list[torch.Tensor | None] = [None] * hp.num_layers  # (S, Hkv, Dh), torch path
        self.v: list[torch.Tensor | None] = [None] * hp.num_layers
        nb = -(-num_tokens // KEY_PAD)
        self.pool = [torch.zeros(2, hp.num_kv_heads, nb, KEY_PAD, hp.head_dim, dtype=dtype, device=device)
                     for _ in range(hp.num_layers)] if native else []
        self.table = torch.arange(nb, dtype=torch.int32, device=device).view(1, nb)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.q_pos is not None
        if self.native:
            pos = self.q_pos.to(torch.int32)
            return kernels.paged_attention(q, self.pool[layer], self.table, torch.zeros_like(pos), pos, self.scale,
                                           new_kv=(k, v, self.q_pos))
        old_k, old_v = self.k[layer], self.v[layer]
        new_k = k if old_k is None else torch.cat([old_k, k])
        new_v = v if old_v is None else torch.cat([old_v, v])
        self.k[layer], self.v[layer] = new_k, new_v
        kk = new_k.transpose(0, 1).unsqueeze(1)  # (Hkv, 1, S, Dh)
        vv = new_v.transpose(0, 1).unsqueeze(1)
        out = attention_core(q[None], kk, vv, self.q_pos[None], self.scale)
        return out[0]


class LlamaModel:
    """Weights plus the forward; stateless between calls (all K/V lives in the backend)."""

    def __init__(self, loaded: LoadedGGUF, dtype: str = "bf16", device: str | torch.device = "cpu",
                 native: bool | None = None) -> None:
        """native: run isolab's native kernels (None: wherever they build and apply; False: torch ops)."""
        hp = loaded.hparams
        self.hp = hp
        self.dtype = TORCH_DTYPES[dtype]
        self.device = torch.device(device)
        t = loaded.tensors

        def w(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(t[name], dtype=np.float32)).to(device=self.device, dtype=self.dtype)

        self.embed = w("token_embd.weight")  # (V, D)
        # tied embeddings: the head is packed apart from the (V, D) table that lookups read
        self.lm_head = Weight(w("output.weight") if "output.weight" in t else self.embed)
        self.final_norm = w("output_norm.weight")
        self.layers: list[Layer] = []
        for i in range(hp.num_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=w(p + "attn_norm.weight"),
                wqkv=Weight(torch.cat([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")])),
                wo=Weight(w(p + "attn_output.weight")),
                ffn_norm=w(p + "ffn_norm.weight"),
                w_gate_up=Weight(torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")])),
                w_down=Weight(w(p + "ffn_down.weight")),
            ))
        inv_freq = 1.0 / (hp.rope_theta ** (torch.arange(0, hp.head_dim, 2, dtype=torch.int64).float() / hp.head_dim))
        pos = torch.arange(hp.context_length, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # (P, Dh/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, Dh)
        self.rope_cos = emb.cos().to(self.device, self.dtype)
        self.rope_sin = emb.sin().to(self.device, self.dtype)
        # Attention reads K/V with isolab's native paged kernel where it builds (CPU), else torch.
        can = kernels.available(self.device, self.dtype, hp.num_heads, hp.num_kv_heads, hp.head_dim)
        if native and not can:
            raise ValueError("native kernels were asked for but do not build or apply here (see isolab/kernels)")
        self.native_kernels = can if native is None else native

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.hp.rms_eps)
        return weight * xf.to(self.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """token_ids, positions: (N,) -> final hidden states (N, D), normed."""
        if self.native_kernels:
            return self._forward_native(token_ids, positions, attn)
        hp = self.hp
        N = token_ids.shape[0]
        H, Hkv, Dh = hp.num_heads, hp.num_kv_heads, hp.head_dim
        x = self.embed[token_ids]  # (N, D)
        cos = self.rope_cos[positions].unsqueeze(1)  # (N, 1, Dh)
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, L in enumerate(self.layers):
            h = self._rms_norm(x, L.attn_norm)
            qkv = L.wqkv(h)  # (N, (H + 2 Hkv) Dh)
            qk = self._rope(qkv[:, : (H + Hkv) * Dh].view(N, H + Hkv, Dh), cos, sin)  # q and k in one pass
            v = qkv[:, (H + Hkv) * Dh :].view(N, Hkv, Dh)
            o = attn.attend(i, qk[:, :H], qk[:, H:], v)  # (N, H, Dh)
            x = x + L.wo(o.reshape(N, H * Dh))
            h = self._rms_norm(x, L.ffn_norm)
            gate, up = L.w_gate_up(h).chunk(2, dim=-1)
            x = x + L.w_down(F.silu(gate) * up)
        return self._rms_norm(x, self.final_norm)

    def _forward_native(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """The same forward with isolab's fused per-row kernels between the GEMMs: 4 native calls and
        4 GEMMs a layer instead of about 35 torch ops. Same rounding points as the torch path."""
        hp = self.hp
        N = token_ids.shape[0]
        H, Hkv, Dh, eps = hp.num_heads, hp.num_kv_heads, hp.head_dim, hp.rms_eps
        x = self.embed[token_ids]  # (N, D), our own copy: the residual stream, updated in place
        h = kernels.rms_norm(x, self.layers[0].attn_norm, eps)
        for i, L in enumerate(self.layers):
            qkv = L.wqkv(h)  # (N, (H + 2 Hkv) Dh)
            kernels.rope_(qkv, self.rope_cos, self.rope_sin, positions, H + Hkv, Dh)  # q and k
            q = qkv[:, : H * Dh].view(N, H, Dh)
            k = qkv[:, H * Dh : (H + Hkv) * Dh].view(N, Hkv, Dh)
            v = qkv[:, (H + Hkv) * Dh :].view(N, Hkv, Dh)
            o = attn.attend(i, q, k, v)  # (N, H, Dh)
            h = kernels.add_rms_norm_(x, L.wo(o.reshape(N, H * Dh)), L.ffn_norm, eps)
            down = L.w_down(kernels.silu_mul(L.w_gate_up(h)))
            norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            h = kernels.add_rms_norm_(x, down, norm, eps)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, D) -> (M, V) float32."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The naive path: the whole sequence in one forward, dense K/V. (T,) -> (T, V) float32."""
        ids = torch.tensor(token_ids, device=self.device)
        pos = torch.arange(len(token_ids), device=self.device)
        kv = DenseKV(self.hp, len(token_ids), self.dtype, self.device, self.native_kernels)
        kv.q_pos = pos
        return self.logits(self.forward(ids, pos, kv))
