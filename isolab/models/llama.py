"""Owns the Llama forward pass in PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied head.

Does not own the KV cache: each layer hands its new K/V to an `AttentionBackend`, which stores
them wherever it keeps K/V (a dense tensor for the reference path, the paged pool for the
engine) and returns the attention output. `attention_core` is the one attention kernel both use,
so a paged run and the reference run do the same arithmetic.

Batch invariance: every op gives a row the same bits whatever else is in the batch. The GEMMs
run on the path models/invariance.py chose and verified at start (models/linear.py; isolab's own
GEMM wherever the native kernels build), attention and the row ops are isolab's native kernels,
each computing a row in an order fixed by the row alone. The torch path's attention is invariant
in bf16 (softmax over keys masked with -inf is unchanged by padding), not in fp32 (MKL's bmm):
the check reports it. See docs/engine.md, "Numerics".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from isolab import kernels
from isolab.kernels import quant
from isolab.models import gemma3, invariance, qwen
from isolab.models.attention import KEY_PAD, attention_core
from isolab.models.gguf_loader import LlamaHParams, LoadedGGUF, RawTensor
from isolab.models.linear import BlockWeight, GemmPath, QuantWeight, StackedWeight, Weight, path_applies
from isolab.models.rope import RopeTables
from isolab.models.weight_cache import WeightCache

Linear = Weight | QuantWeight | BlockWeight | StackedWeight

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


WEIGHTS = ("native", "dense")


def _native_format(loaded: LoadedGGUF, names: list[str]) -> bool:
    """Whether these tensors (stacked along N) can stay in their GGUF blocks: native types, K % 32 == 0."""
    return all(loaded.raw[n].qtype in quant.NATIVE_TYPES and loaded.raw[n].shape[-1] % quant.QK == 0 for n in names)


class Embedding:
    """Token embeddings read from the GGUF's blocks (the mmapped file) row by row: one copy of the
    table, shared with a tied head that multiplies on the same blocks."""

    def __init__(self, raw: RawTensor, dtype: torch.dtype, device: torch.device) -> None:
        self.raw, self.dtype, self.device = raw, dtype, device

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, D), a fresh tensor
        vals = self.raw.dequantize(ids.cpu().numpy())
        return torch.from_numpy(vals).to(device=self.device, dtype=self.dtype)


class PackedEmbedding:
    """Token embeddings of a tied model read from the head's packed records (kernels/quant.py:
    dequantize_rows gives the GGUF's own values): the table and the head are one copy."""

    def __init__(self, head: QuantWeight, dtype: torch.dtype, device: torch.device) -> None:
        assert head.packed is not None
        self.head, self.dtype, self.device = head, dtype, device
        self.k = head.packed.shape[1] * quant.QK

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, D), a fresh tensor
        h = self.head
        vals = quant.dequantize_rows(h.packed, h.fmt, h.fp16, ids.cpu().numpy(), self.k)  # type: ignore[arg-type]
        return torch.from_numpy(vals).to(device=self.device, dtype=self.dtype)


@dataclass(frozen=True)
class Layer:
    attn_norm: torch.Tensor  # (D,)
    wqkv: Linear  # (H*Dh + 2*Hkv*Dh, D): q, k, v in one GEMM
    wo: Linear  # (D, H*Dh)
    ffn_norm: torch.Tensor  # (D,)
    w_gate_up: Linear  # (2I, D): gate and up in one GEMM
    w_down: Linear  # (D, I)
    qkv_bias: torch.Tensor | None = None  # (H*Dh + 2*Hkv*Dh,): qwen2
    q_norm: torch.Tensor | None = None  # (Dh,): RMSNorm weight over each q head, before RoPE (qwen3)
    k_norm: torch.Tensor | None = None  # (Dh,): the same for k
    post_attn_norm: torch.Tensor | None = None  # (D,) gemma3: RMSNorm of the attention output, fp32 weights
    post_ffn_norm: torch.Tensor | None = None  # (D,) gemma3: RMSNorm of the MLP output


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Store k, v (N, Hkv, Dh) of this step's N tokens; return attention of q (N, H, Dh) -> (N, H, Dh).
        window > 0: each query sees only its last `window` positions (a local layer)."""
        ...

    def fused(self) -> FusedAttention | None:
        """The same attention as arguments of the one-call native forward, or None (then `attend` runs)."""
        ...


@dataclass(frozen=True)
class FusedAttention:
    """Everything the native attention kernel reads in a step, for every layer at once."""

    k_pools: object  # C array of each layer's K pool pointer (KVStorage.pool_pointers)
    v_pools: object
    tables: torch.Tensor  # (R, table_len) int32
    row_table: torch.Tensor  # (N,) int32
    q_pos: torch.Tensor  # (N,) int32
    slots: torch.Tensor  # (N,) int64: where each row's new K/V go
    num_blocks: int
    block_size: int
    scale: float
    kv_i8: bool = False  # k_pools are int8 pools (models/attention.py:i8_pool_shape); v_pools unused


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
        self.pointers = (kernels.pointer_array([p[0] for p in self.pool]),
                         kernels.pointer_array([p[1] for p in self.pool])) if native else None

    def fused(self) -> FusedAttention | None:
        if not self.native or self.q_pos is None:
            return None
        pos = self.q_pos.to(torch.int32)
        assert self.pointers is not None
        return FusedAttention(*self.pointers, self.table, torch.zeros_like(pos), pos, self.q_pos.to(torch.int64),
                              self.pool[0].shape[2], self.pool[0].shape[3], self.scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        assert self.q_pos is not None
        if self.native:
            pos = self.q_pos.to(torch.int32)
            return kernels.paged_attention(q, self.pool[layer], self.table, torch.zeros_like(pos), pos, self.scale,
                                           new_kv=(k, v, self.q_pos), window=window)
        old_k, old_v = self.k[layer], self.v[layer]
        new_k = k if old_k is None else torch.cat([old_k, k])
        new_v = v if old_v is None else torch.cat([old_v, v])
        self.k[layer], self.v[layer] = new_k, new_v
        kk = new_k.transpose(0, 1).unsqueeze(1)  # (Hkv, 1, S, Dh)
        vv = new_v.transpose(0, 1).unsqueeze(1)
        out = attention_core(q[None], kk, vv, self.q_pos[None], self.scale, window=window)
        return out[0]


class LlamaModel:
    """Weights plus the forward; stateless between calls (all K/V lives in the backend)."""

    def __init__(self, loaded: LoadedGGUF, dtype: str = "bf16", device: str | torch.device = "cpu",
                 native: bool | None = None, gemm: GemmPath | None = None, weights: str = "dense",
                 dense_blocks: bool = True) -> None:
        """dtype: activations and K/V. native: run isolab's native kernels (None: wherever they
        build and apply; False: torch ops). gemm: the dense GEMM path (None: the first that passes
        the invariance check here; a name: that path, checked and reported but kept whatever the
        verdict). weights: "native" keeps the GGUF's quantized blocks and multiplies on them
        (kernels/qgemm.cpp; tensors of other types run dense), "dense" dequantizes every weight to
        `dtype` (the fp32 dense path is the bit-exact reference of the golden tests). Where the
        native kernels run, the packed weights (native records, bf16 panels) are mapped from
        models/weight_cache.py's files (self.weight_cache says what it did). dense_blocks: where bf16
        GEMMs run dense on the tile unit, keep quantized weights in their GGUF blocks and dequantize
        each block as the tile unit takes it (kernels/qdense.cpp: the panels' bits, a third of the
        bytes); False keeps bf16 panels."""
        hp = loaded.hparams
        self.hp = hp
        self.dtype = TORCH_DTYPES[dtype]
        self.device = torch.device(device)
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
        self.weights = weights
        t = loaded.tensors
        # Attention and row ops: isolab's native kernels where they build (CPU), else torch.
        can = kernels.available(self.device, self.dtype, hp.num_heads, hp.num_kv_heads, hp.head_dim)
        if native and not can:
            raise ValueError("native kernels were asked for but do not build or apply here (see isolab/kernels)")
        self.native_kernels = can if native is None else native
        H, Hkv, Dh = hp.num_heads, hp.num_kv_heads, hp.head_dim
        head = "output.weight" if "output.weight" in loaded.raw else "token_embd.weight"
        stacks = [[head]] + [[f"blk.{i}.{n}.weight" for n in names] for i in range(hp.num_layers)
                             for names in (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"],
                                           ["ffn_down"])]
        # the GEMMs that run on GGUF blocks, by record format and shape, and those that run dense
        # (block_shapes: dense bf16 GEMMs whose weights can stay in their blocks, kernels/qdense.cpp)
        quant_shapes: set[tuple[str, int, int]] = set()
        dense_shapes: set[tuple[int, int]] = set()
        block_shapes: set[tuple[str, int, int]] = set()
        blocks = (self.dtype == torch.bfloat16 and self.device.type == "cpu" and can and native is not False
                  and kernels.native_ready() and kernels.qdense_isa() == "amx"
                  and dense_blocks and gemm in (None, "isolab"))
        for names in stacks:
            k = loaded.raw[names[0]].shape[-1]
            groups = [(fmt, fp16, sum(loaded.raw[names[i]].shape[0] for i in idx))
                      for fmt, fp16, idx in quant.plan([loaded.raw[n].qtype for n in names])] \
                if _native_format(loaded, names) else []
            if weights == "native" and groups:
                quant_shapes.update((quant.format_label(fmt, fp16), n, k) for fmt, fp16, n in groups)
            else:
                dense_shapes.add((sum(loaded.raw[n].shape[0] for n in names), k))
                if blocks and groups:
                    block_shapes.update((quant.format_label(fmt, fp16), n, k) for fmt, fp16, n in groups)
        if self.dtype == torch.bfloat16 and any(k % 2 for _, k in dense_shapes) and gemm is None:
            gemm = "onednn" if path_applies("onednn", self.device, self.dtype, False) else "fixed-tile"
        on_blocks = self.native_kernels and kernels.native_ready()  # qgemm.cpp; else the torch reference
        # What the proof stands on: measured here, on these shapes (cached per machine and shape).
        self.numerics = invariance.choose(sorted(dense_shapes), self.dtype, self.device, (H, Hkv, Dh),
                                          self.native_kernels, forced=gemm, quant_shapes=sorted(quant_shapes),
                                          quant_native=on_blocks, block_shapes=sorted(block_shapes))
        path: GemmPath = self.numerics.gemm_path  # type: ignore[assignment]
        blocks = bool(self.numerics.block_shapes)  # the check ran them (on the isolab path) and kept them

        def w(name: str) -> torch.Tensor:
            if hp.gemma and name.endswith("norm.weight"):  # gemma multiplies by its norm weights in fp32
                return wf(name)
            return torch.from_numpy(np.array(t[name], dtype=np.float32)).to(device=self.device, dtype=self.dtype)

        def wf(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(t[name], dtype=np.float32)).to(device=self.device)

        def unpack(names: list[str]) -> list[quant.Unpacked]:
            return [quant.unpack_gguf(loaded.raw[n].data, loaded.raw[n].qtype, loaded.raw[n].shape) for n in names]

        split = gemm == "split-k"  # FAULT batch-variant-gemm reaches the quantized GEMMs too
        # the native kernels' weights (quantized records; isolab's bf16 panels and table): mapped from
        # the on-disk cache, packed there by a first start. fp32 dense weights, the golden tests'
        # reference, stay in memory (4 bytes a weight on disk would be a lot to keep for a check).
        cache = WeightCache(loaded.fingerprint) if on_blocks and not split else None
        self.weight_cache = cache
        dense_cache = cache if self.dtype == torch.bfloat16 and path == "isolab" else None

        def dense(names: list[str]) -> Weight | BlockWeight | StackedWeight:
            def full() -> torch.Tensor:
                return torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])

            n, k = sum(loaded.raw[x].shape[0] for x in names), loaded.raw[names[0]].shape[-1]
            if blocks and _native_format(loaded, names):  # the blocks, multiplied as the panels would be
                return in_blocks(names)
            if dense_cache is None or k % 2:  # (bf16 panels need an even K)
                return Weight(full(), path)
            packed = dense_cache.records(f"{'+'.join(names)}.bf16", kernels.packed_shape(n, k, self.dtype),
                                         lambda: kernels.pack_weight(full()), self.dtype)
            return Weight.from_packed(packed, n)

        def pack(names: list[str]) -> torch.Tensor:
            return quant.pack(quant.concat(unpack(names)))

        def pack_rows(names: list[str]) -> torch.Tensor:
            return quant.pack_rows(quant.concat(unpack(names)))

        def in_blocks(names: list[str]) -> BlockWeight | StackedWeight:
            k = loaded.raw[names[0]].shape[-1]
            ws: list[BlockWeight] = []
            for fmt, fp16, idx in quant.plan([loaded.raw[n].qtype for n in names]):  # as concat stacks them
                sub = [names[i] for i in idx]
                n = sum(loaded.raw[x].shape[0] for x in sub)
                qtype = "+".join(sorted({loaded.raw[x].qtype for x in sub}))
                if cache is None:
                    ws.append(BlockWeight.from_unpacked(quant.concat(unpack(sub))))
                    continue
                shape = (-(-n // quant.PANEL), k // quant.QK, quant.record_bytes(fmt, fp16))
                packed = cache.records("+".join(sub) + ".rows", shape,
                                       functools.partial(pack_rows, sub))
                ws.append(BlockWeight(packed, n, fmt, fp16, qtype))
            return ws[0] if len(ws) == 1 else StackedWeight(ws)

        def cached(names: list[str], out_dtype: torch.dtype | None) -> QuantWeight | StackedWeight:
            assert cache is not None
            k = loaded.raw[names[0]].shape[-1]
            ws: list[Weight | QuantWeight] = []
            for fmt, fp16, idx in quant.plan([loaded.raw[n].qtype for n in names]):  # as concat stacks them
                sub = [names[i] for i in idx]
                n = sum(loaded.raw[x].shape[0] for x in sub)
                shape = (-(-n // quant.PANEL), k // quant.QK, quant.record_bytes(fmt, fp16))
                packed = cache.records("+".join(sub), shape, functools.partial(pack, sub))
                qtype = "+".join(sorted({loaded.raw[x].qtype for x in sub}))
                ws.append(QuantWeight.from_records(packed, n, fmt, fp16, qtype, out_dtype))
            return ws[0] if len(ws) == 1 else StackedWeight(ws)  # type: ignore[return-value]

        def linear(names: list[str], out_dtype: torch.dtype | None = None) -> Linear:
            if not _native_format(loaded, names) or weights != "native":
                return dense(names)
            if cache is not None:
                return cached(names, out_dtype)
            parts = unpack(names)
            try:
                return QuantWeight(quant.concat(parts), self.device, on_blocks, out_dtype, split)
            except ValueError:  # u4 beside s8: one GEMM each
                return StackedWeight([QuantWeight(p, self.device, on_blocks, out_dtype, split) for p in parts])

        # the head: logits in fp32 straight from the accumulators where it runs on the blocks
        self.lm_head = linear([head], torch.float32)
        if weights == "native" and head == "token_embd.weight" and isinstance(self.lm_head, QuantWeight) \
                and self.lm_head.packed is not None:  # tied: the table is read from the head's records
            self.embed: Embedding | PackedEmbedding | torch.Tensor = PackedEmbedding(self.lm_head, self.dtype, self.device)
        elif weights == "native":  # rows read from the mmapped file as they are asked for
            self.embed = Embedding(loaded.raw["token_embd.weight"], self.dtype, self.device)
        else:
            table = "token_embd.weight"
            self.embed = w(table) if dense_cache is None else dense_cache.records(  # (V, D)
                f"{table}.rows.bf16", tuple(loaded.raw[table].shape), lambda: w(table), self.dtype)
        self.final_norm = w("output_norm.weight")
        self.layers: list[Layer] = []
        for i in range(hp.num_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=w(p + "attn_norm.weight"),
                wqkv=linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
                wo=linear([p + "attn_output.weight"]),
                ffn_norm=w(p + "ffn_norm.weight"),
                w_gate_up=linear([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                w_down=linear([p + "ffn_down.weight"]),
                qkv_bias=torch.cat([w(p + f"attn_{x}.bias") for x in "qkv"]) if hp.qkv_bias else None,
                q_norm=w(p + "attn_q_norm.weight") if hp.qk_norm else None,
                k_norm=w(p + "attn_k_norm.weight") if hp.qk_norm else None,
                post_attn_norm=wf(p + "post_attention_norm.weight") if hp.gemma else None,
                post_ffn_norm=wf(p + "post_ffw_norm.weight") if hp.gemma else None,
            ))
        self._fused = self._fused_layers() if self.native_kernels and kernels.native_ready() else None
        # built as positions are asked for, up to the context (models/rope.py)
        self.rope = RopeTables(hp.rope_theta, hp.head_dim, hp.context_length, self.dtype, self.device)
        if hp.gemma:  # local layers: their own RoPE base; embeddings scaled by sqrt(D), rounded as transformers does
            self.rope_local = RopeTables(hp.rope_theta_local, hp.head_dim, hp.context_length, self.dtype, self.device)
            self.embed_scale = torch.tensor(hp.hidden_size ** 0.5, dtype=self.dtype)

    def linears(self) -> list[Linear]:
        """Every GEMM's weight: the head, then each layer's wqkv, wo, w_gate_up, w_down."""
        return [self.lm_head] + [w for L in self.layers for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]

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
        if self.hp.gemma:
            return gemma3.forward(self, token_ids, positions, attn)
        if self.native_kernels:
            return self._forward_native(token_ids, positions, attn)
        hp = self.hp
        N = token_ids.shape[0]
        H, Hkv, Dh = hp.num_heads, hp.num_kv_heads, hp.head_dim
        x = self.embed[token_ids]  # (N, D)
        cos, sin = self.rope.for_positions(positions)
        cos = cos[positions].unsqueeze(1)  # (N, 1, Dh)
        sin = sin[positions].unsqueeze(1)
        for i, L in enumerate(self.layers):
            h = self._rms_norm(x, L.attn_norm)
            qkv = qwen.qkv_extras(self, L, L.wqkv(h), N, native=False)  # (N, (H + 2 Hkv) Dh)
            qk = self._rope(qkv[:, : (H + Hkv) * Dh].view(N, H + Hkv, Dh), cos, sin)  # q and k in one pass
            v = qkv[:, (H + Hkv) * Dh :].view(N, Hkv, Dh)
            o = attn.attend(i, qk[:, :H], qk[:, H:], v)  # (N, H, Dh)
            x = x + L.wo(o.reshape(N, H * Dh))
            h = self._rms_norm(x, L.ffn_norm)
            gate, up = L.w_gate_up(h).chunk(2, dim=-1)
            x = x + L.w_down(F.silu(gate) * up)
        return self._rms_norm(x, self.final_norm)

    def _fused_layers(self):
        """forward.cpp's layer table, where every linear layer runs on a native GEMM (qgemm or the
        dense isolab GEMM) as plain x @ W.T; None otherwise (a StackedWeight, the split-k fault)."""
        def desc(w: Linear) -> kernels.FusedLinear | None:
            if isinstance(w, QuantWeight) and w.packed is not None and w.big_batch is None and w.out_dtype is None:
                return kernels.FusedLinear(w.packed.data_ptr(), 1, w.fmt, int(w.fp16), w.n, w.packed.shape[1] * quant.QK)
            if isinstance(w, BlockWeight):
                return kernels.FusedLinear(w.packed.data_ptr(), 2, w.fmt, int(w.fp16), w.n, w.packed.shape[1] * quant.QK)
            if isinstance(w, Weight) and w.path == "isolab":
                k = w.data.shape[1] * (2 if w.data.dtype == torch.bfloat16 else 1)
                return kernels.FusedLinear(w.data.data_ptr(), 0, 0, 0, w.n, k)
            return None

        if self.hp.qkv_bias or self.hp.qk_norm or self.hp.gemma:  # forward.cpp runs the plain llama layer only
            return None
        table = (kernels.FusedLayer * len(self.layers))()
        for i, L in enumerate(self.layers):
            parts = [desc(w) for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]
            if any(p is None for p in parts):
                return None
            table[i] = kernels.FusedLayer(L.attn_norm.data_ptr(), L.ffn_norm.data_ptr(), *parts)
        return table

    def _forward_native(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """The same forward with isolab's fused per-row kernels between the GEMMs: 4 native calls and
        4 GEMMs a layer instead of about 35 torch ops. Same rounding points as the torch path.
        Where every GEMM is native too, all layers run in one call (forward.cpp): the same kernels in
        the same order, the same bits, without the Python between them."""
        hp = self.hp
        N = token_ids.shape[0]
        H, Hkv, Dh, eps = hp.num_heads, hp.num_kv_heads, hp.head_dim, hp.rms_eps
        x = self.embed[token_ids]  # (N, D), our own copy: the residual stream, updated in place
        h = kernels.rms_norm(x, self.layers[0].attn_norm, eps)
        fa = attn.fused() if self._fused is not None and hasattr(attn, "fused") else None
        cos, sin = self.rope.for_positions(positions)  # (P, Dh) each: every position's row
        if fa is not None:
            kernels.forward_layers(x, h, self._fused, fa.k_pools, fa.v_pools, len(self.layers), self.final_norm,
                                   cos, sin, positions.contiguous(), fa.slots, fa.tables,
                                   fa.row_table, fa.q_pos, (H, Hkv, Dh), fa.num_blocks, fa.block_size, fa.scale, eps,
                                   ((H + 2 * Hkv) * Dh, hp.intermediate_size), fa.kv_i8)
            return h
        for i, L in enumerate(self.layers):
            qkv = qwen.qkv_extras(self, L, L.wqkv(h), N, native=True)  # (N, (H + 2 Hkv) Dh)
            kernels.rope_(qkv, cos, sin, positions, H + Hkv, Dh)  # q and k
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
        return self.logits_raw(hidden).float()

    @torch.inference_mode()
    def logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, D) -> (M, V) in the model's dtype: what the head computes, before any widening
        (the sampler widens only rows that need more than an argmax; bf16 -> fp32 is exact)."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The naive path: the whole sequence in one forward, dense K/V. (T,) -> (T, V) float32."""
        ids = torch.tensor(token_ids, device=self.device)
        pos = torch.arange(len(token_ids), device=self.device)
        kv = DenseKV(self.hp, len(token_ids), self.dtype, self.device, self.native_kernels)
        kv.q_pos = pos
        return self.logits(self.forward(ids, pos, kv))
