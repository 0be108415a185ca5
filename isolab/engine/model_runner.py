"""Owns turning a SchedulerOutput into tensors, running the forward on the paged cache, and logits.

    SchedulerOutput -> (token ids, positions, slot mapping, attention groups) -> model -> logits

Attention groups: all single-token chunks (decode) attend together, padded to the longest
block table; each multi-token chunk attends alone. Padding points at the null block (zeros)
and is masked, so a row's result never depends on what else is in the step (bf16; see llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.kv_storage import KVStorage
from isolab.engine.scheduler import SchedulerOutput
from isolab.models.llama import KEY_PAD, LlamaModel, attention_core, causal_hidden


@dataclass(frozen=True)
class AttentionGroup:
    rows: torch.Tensor  # (B, T) row of each query in the step's flat batch; padding repeats a real row
    valid: torch.Tensor  # (B, T) bool: which entries are real queries
    q_pos: torch.Tensor  # (B, T) absolute positions
    gather_rows: torch.Tensor  # (2 * Hkv * B * nb,) rows of a layer's (2 * Hkv * num_blocks, bs * Dh) view:
    #   (kv, head, row, block-table entry) in that order, tables padded with the null block
    num_blocks: int  # nb: blocks per row after padding
    hidden: torch.Tensor  # (B, T, nb * bs) causal mask, computed once per step
    covers_all: bool  # rows are exactly 0..N-1 in order: the step is this one group


class PagedAttention:
    """AttentionBackend over the paged pool for one step."""

    def __init__(self, storage: KVStorage, slot_mapping: torch.Tensor, groups: list[AttentionGroup], scale: float) -> None:
        self.storage = storage
        self.slot_mapping = slot_mapping  # (N,) flat slot of each new token
        self.groups = groups
        self.scale = scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.storage.layers[layer]  # (2, Hkv, num_blocks, bs, Dh)
        _, hkv, num_blocks, bs, dh = kv.shape
        flat = kv.view(2, hkv, num_blocks * bs, dh)
        flat[0].index_copy_(1, self.slot_mapping, k.transpose(0, 1))
        flat[1].index_copy_(1, self.slot_mapping, v.transpose(0, 1))
        # One gather of whole 2 KiB (block, head) rows along dim 0 of a contiguous view: measured
        # 1.6x faster than index_select along the block dim of (Hkv, num_blocks, bs, Dh).
        rows = kv.view(2 * hkv * num_blocks, bs * dh)
        if len(self.groups) == 1 and self.groups[0].covers_all:
            g = self.groups[0]
            B = g.rows.shape[0]
            kvb = rows.index_select(0, g.gather_rows).view(2, hkv, B, g.num_blocks * bs, dh)
            o = attention_core(q.view(B, -1, *q.shape[1:]), kvb[0], kvb[1], g.q_pos, self.scale, g.hidden)
            return o.view(q.shape)
        out = torch.empty_like(q)
        for g in self.groups:
            B = g.rows.shape[0]
            kvb = rows.index_select(0, g.gather_rows).view(2, hkv, B, g.num_blocks * bs, dh)  # K, V: (Hkv, B, S, Dh)
            o = attention_core(q[g.rows], kvb[0], kvb[1], g.q_pos, self.scale, g.hidden)  # (B, T, H, Dh)
            out[g.rows[g.valid]] = o[g.valid]
        return out


@dataclass(frozen=True)
class ForwardResult:
    logits: torch.Tensor  # (M, V) float32, one row per sampling chunk, in chunk order
    sample_chunk_indices: tuple[int, ...]  # which chunks the rows belong to


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage, kv: KVCacheManager) -> None:
        self.model = model
        self.storage = storage
        self.kv = kv
        self.device = model.device
        self.scale = model.hp.head_dim ** -0.5
        self.num_kv_heads = model.hp.num_kv_heads

    def _group(self, rows: torch.Tensor, q_pos: torch.Tensor, tables: list[list[int]], covers_all: bool) -> AttentionGroup:
        # Pad every table to the same number of blocks, and the key count to a multiple of KEY_PAD.
        bs = self.kv.block_size
        nb = max(len(t) for t in tables)
        nb = -(-nb * bs // KEY_PAD) * KEY_PAD // bs if (nb * bs) % KEY_PAD else nb
        ids = torch.tensor([b for t in tables for b in t + [0] * (nb - len(t))], device=self.device)
        planes = torch.arange(2 * self.num_kv_heads, device=self.device).view(-1, 1) * self.storage.num_blocks
        return AttentionGroup(rows, torch.ones_like(rows, dtype=torch.bool), q_pos, (planes + ids).view(-1), nb,
                              causal_hidden(q_pos, nb * bs), covers_all=covers_all)

    def execute(self, out: SchedulerOutput) -> ForwardResult:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode: list[tuple[int, int, list[int]]] = []  # (row, position, block table)
        groups: list[AttentionGroup] = []
        last_rows: list[int] = []
        sample_idx: list[int] = []
        dev = self.device
        for ci, ch in enumerate(out.chunks):
            req = ch.request
            row0 = len(token_ids)
            pos = range(ch.start, ch.start + ch.num_new_tokens)
            token_ids.extend(req.token_ids[ch.start : ch.start + ch.num_new_tokens])
            positions.extend(pos)
            slots.extend(self.kv.slot(req, p) for p in pos)
            n_ctx_blocks = self.kv.num_blocks_needed(ch.start + ch.num_new_tokens)
            table = self.kv.block_table(req)[:n_ctx_blocks]
            if ch.num_new_tokens == 1:
                decode.append((row0, ch.start, table))
            else:
                T = ch.num_new_tokens
                groups.append(self._group(
                    torch.arange(row0, row0 + T, device=dev).view(1, T), torch.tensor(list(pos), device=dev).view(1, T),
                    [table], covers_all=len(out.chunks) == 1,
                ))
            if ch.samples:
                last_rows.append(len(token_ids) - 1)
                sample_idx.append(ci)
        if decode:
            groups.append(self._group(
                torch.tensor([r for r, _, _ in decode], device=dev).view(-1, 1),
                torch.tensor([p for _, p, _ in decode], device=dev).view(-1, 1),
                [t for _, _, t in decode], covers_all=len(decode) == len(out.chunks),
            ))
        attn = PagedAttention(self.storage, torch.tensor(slots, device=dev), groups, self.scale)
        hidden = self.model.forward(torch.tensor(token_ids, device=dev), torch.tensor(positions, device=dev), attn)
        if not last_rows:
            return ForwardResult(torch.empty(0, self.model.hp.vocab_size), ())
        logits = self.model.logits(hidden[torch.tensor(last_rows, device=dev)])
        return ForwardResult(logits, tuple(sample_idx))
