"""Owns turning a SchedulerOutput into tensors, the forward on the paged cache, logits and sampling.

    SchedulerOutput -> (token ids, positions, slot mapping, block tables) -> model -> logits
        -> sampler (each request's own generator) -> ModelRunnerOutput

Reads requests and asks the cache manager for slots and block tables; writes no request and no
block bookkeeping (Scheduler.update commits what was computed).

Native path (CPU): every row hands the kernel its chunk's block table and its position; the
kernel reads keys 0..position in place, one row at a time, so a row's bits never depend on what
else is in the step, in bf16 and fp32 alike (isolab/kernels).

KV cache groups (kv_groups.py): each layer reads and writes its group's block tables and slots;
with one group (every model but Gemma 3 with the window cache) that is the one table.

Torch path (no kernel, e.g. CUDA): attention groups. All single-token chunks (decode) attend
together, padded to the longest block table; each multi-token chunk attends alone. Padding points
at the null block (zeros) and is masked (bf16 keeps a row's bits; see llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isolab import kernels
from isolab.engine.kv_cache_manager import KVCacheManager
from isolab.engine.kv_groups import KVGroup
from isolab.engine.kv_storage import KVStorage
from isolab.engine.request import Request, TokenLogprob
from isolab.engine.sampler import make_generator, sample, top_logprobs
from isolab.engine.step import ModelRunnerOutput, SampledToken, SchedulerOutput
from isolab.faults import Faults
from isolab.models.attention import (
    KEY_PAD,
    attention_core,
    causal_hidden,
    gather_kv,
    gather_kv_i8,
    write_kv,
    write_kv_i8,
)
from isolab.models.llama import FusedAttention, LlamaModel


@dataclass(frozen=True)
class AttentionGroup:
    rows: torch.Tensor  # (B, T) row of each query in the step's flat batch
    q_pos: torch.Tensor  # (B, T) absolute positions
    gather_rows: torch.Tensor  # (2 * Hkv * B * nb,) rows of a layer's (2 * Hkv * num_blocks, bs * Dh) view:
    #   (kv, head, row, block-table entry) in that order, tables padded with the null block
    num_blocks: int  # nb: blocks per row after padding
    hidden: torch.Tensor  # (B, T, nb * bs) causal mask, computed once per step
    block_ids: torch.Tensor  # (B, nb) each row's block table, padded with the null block (the int8 pool's gather)


@dataclass(frozen=True)
class NativeTables:
    """What the native kernel reads for one step (isolab/kernels): every row's table and position."""

    tables: torch.Tensor  # (R, table_len) int32: one block table per chunk, padded with the null block
    row_table: torch.Tensor  # (N,) int32: the chunk of each row
    q_pos: torch.Tensor  # (N,) int32: the row sees keys 0..q_pos, all inside its own table


class PagedAttention:
    """AttentionBackend over the paged pool for one step: write this step's K/V, then read.

    Native path: the kernel reads each row's blocks in place, keys 0..q_pos only. Torch path
    (no kernel, e.g. CUDA): gather each group's blocks, then attention_core with a causal mask.
    """

    def __init__(self, storage: KVStorage, slot_mappings: list[torch.Tensor], scale: float,
                 native: list[NativeTables] | None, groups: list[list[AttentionGroup]], group_of_layer: list[int]) -> None:
        self.storage = storage
        self.slot_mappings = slot_mappings  # per KV group: (N,) flat slot of each new token
        self.scale = scale
        self.native = native  # per KV group
        self.groups = groups  # per KV group: its attention groups (torch path)
        self.group_of_layer = group_of_layer  # layer -> its KV group

    def fused(self) -> FusedAttention | None:
        """What the one-call native forward needs (models/llama.py); None on the torch path."""
        if self.native is None:
            return None
        assert len(self.native) == 1, "the one-call forward runs models of one KV group"
        n, st = self.native[0], self.storage
        k_pools, v_pools = st.pool_pointers()
        return FusedAttention(k_pools, v_pools, n.tables, n.row_table, n.q_pos, self.slot_mappings[0], st.num_blocks,
                              st.block_size, self.scale, st.int8)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        kv = self.storage.layers[layer]  # (2, Hkv, num_blocks, bs, Dh) as write_kv lays blocks; int8: i8_pool_shape
        group = self.group_of_layer[layer]
        slot_mapping = self.slot_mappings[group]
        if self.native is not None:
            n = self.native[group]
            return kernels.paged_attention(q, kv, n.tables, n.row_table, n.q_pos, self.scale,
                                           new_kv=(k, v, slot_mapping), window=window)
        i8 = self.storage.int8
        if i8:
            write_kv_i8(kv, slot_mapping, k, v)
        else:
            write_kv(kv, slot_mapping, k, v, native=False)
        out = torch.empty_like(q)
        for g in self.groups[group]:
            if i8:
                kb, vb = gather_kv_i8(kv, g.block_ids, q.dtype)
            else:
                kb, vb = gather_kv(kv, g.gather_rows, g.rows.shape[0], native=False)  # (Hkv, B, S, Dh)
            o = attention_core(q[g.rows], kb, vb, g.q_pos, self.scale, g.hidden, window)  # (B, T, H, Dh)
            out[g.rows.view(-1)] = o.view(-1, *o.shape[2:])
        return out


@dataclass(frozen=True)
class StepInputs:
    token_ids: torch.Tensor  # (N,) the tokens computed this step, chunk after chunk
    positions: torch.Tensor  # (N,) their absolute positions
    attn: PagedAttention  # where each row's K/V go and which keys it reads
    last_rows: torch.Tensor | None  # (M,) the row of each sampling chunk's last token; None if none samples
    # prompt logprobs: the rows whose next token is a prompt token, and per chunk (request, the first
    # such prompt position + 1, how many); None/() when no chunk asks
    prompt_rows: torch.Tensor | None = None  # (P,)
    prompt_spans: tuple[tuple[Request, int, int], ...] = ()


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage, kv: KVCacheManager, faults: Faults = Faults(),
                 eos_token_id: int | None = None, kv_groups: tuple[KVGroup, ...] | None = None,
                 end_of_turn: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.storage = storage
        self.kv = kv
        kv_groups = kv_groups or (KVGroup(tuple(range(model.hp.num_layers)), 0),)
        assert len(kv_groups) == kv.num_groups
        self.group_of_layer = [0] * model.hp.num_layers
        for g, group in enumerate(kv_groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.device = model.device
        self.scale = model.hp.head_dim ** -0.5
        self.eos_token_id = eos_token_id  # min_tokens masks it
        self.end_of_turn = end_of_turn  # and these (tokens that stop a request as EOS does)
        # FAULT shared-rng: one generator for every request (seeded once, at start); read only here.
        self.shared_generator = make_generator(0, model.device) if faults.shared_rng else None

    def _group(self, rows: torch.Tensor, q_pos: torch.Tensor, tables: list[list[int]]) -> AttentionGroup:
        # Pad every table to the same number of blocks, and the key count to a multiple of KEY_PAD.
        bs = self.kv.block_size
        nb = max(len(t) for t in tables)
        nb = -(-nb * bs // KEY_PAD) * KEY_PAD // bs if (nb * bs) % KEY_PAD else nb
        ids = torch.tensor([b for t in tables for b in t + [0] * (nb - len(t))], device=self.device)
        planes = torch.arange(2 * self.model.hp.num_kv_heads, device=self.device).view(-1, 1) * self.storage.num_blocks
        return AttentionGroup(rows, q_pos, (planes + ids).view(-1), nb, causal_hidden(q_pos, nb * bs),
                              ids.view(len(tables), nb))

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute every chunk's K/V into the pool, and sample one token for each sampling chunk."""
        inputs = self.prepare(out)
        hidden = self.model.forward(inputs.token_ids, inputs.positions, inputs.attn)  # (N, D)
        prompt_lps = self._prompt_logprobs(hidden, inputs) if inputs.prompt_spans else ()
        sampling = [ch.request for ch in out.chunks if ch.samples]
        if inputs.last_rows is None:
            return ModelRunnerOutput((), prompt_lps)
        logits = self.model.logits_raw(hidden[inputs.last_rows])  # (M, V) one row per sampling chunk
        drawn = sample(logits, sampling, self.shared_generator, self.eos_token_id, self.end_of_turn)
        return ModelRunnerOutput(tuple(
            SampledToken(req.request_id, token, lp) for req, (token, lp) in zip(sampling, drawn, strict=True)
        ), prompt_lps)

    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """(M, V) float32 logits of the last row of each sampling chunk, in chunk order (no sampling)."""
        inputs = self.prepare(out)
        hidden = self.model.forward(inputs.token_ids, inputs.positions, inputs.attn)  # (N, D)
        if inputs.last_rows is None:
            return torch.empty(0, self.model.hp.vocab_size)
        return self.model.logits(hidden[inputs.last_rows])

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> tuple[tuple[str, int, tuple[TokenLogprob, ...]], ...]:
        """Each asking chunk's prompt tokens' logprobs: row p's distribution scores prompt token p + 1."""
        assert inputs.prompt_rows is not None
        logp = torch.log_softmax(self.model.logits(hidden[inputs.prompt_rows]), -1)  # (P, V), rows independent
        tops = top_logprobs(logp, [req.params.prompt_logprobs or 0 for req, _, n in inputs.prompt_spans for _ in range(n)])
        out, row = [], 0
        for req, first, n in inputs.prompt_spans:
            nxt = torch.tensor(req.token_ids[first : first + n], device=logp.device)
            picked = logp[torch.arange(row, row + n, device=logp.device), nxt].tolist()
            lps = [TokenLogprob(req.token_ids[first + j], float(picked[j]), tops[row + j]) for j in range(n)]
            out.append((req.request_id, first, tuple(lps)))
            row += n
        return tuple(out)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's tensors: what the forward reads, built from the chunks and the cache manager."""
        token_ids: list[int] = []
        positions: list[int] = []
        num_groups = self.kv.num_groups
        slots: list[list[int]] = [[] for _ in range(num_groups)]  # per KV group
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]  # per KV group: the context blocks of each chunk
        row_chunk: list[int] = []  # native path: the chunk of each row
        last_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []
        dev = self.device
        for ci, ch in enumerate(out.chunks):
            req = ch.request
            if req.params.prompt_logprobs is not None:  # rows whose next token is a prompt token
                n = min(ch.end, req.num_prompt_tokens - 1) - ch.start
                if n > 0:
                    prompt_rows.extend(range(len(token_ids), len(token_ids) + n))
                    prompt_spans.append((req, ch.start + 1, n))
            token_ids.extend(req.token_ids[ch.start : ch.end])
            positions.extend(range(ch.start, ch.end))
            for g in range(num_groups):
                slots[g].extend(self.kv.slot_mapping(req, ch.start, ch.num_new_tokens, g))
                tables[g].append(self.kv.block_table(req, ch.end, g))
            row_chunk.extend([ci] * ch.num_new_tokens)
            if ch.samples:
                last_rows.append(len(token_ids) - 1)
        slot_mappings = [torch.tensor(s, device=dev) for s in slots]
        if self.model.native_kernels:
            row_table = torch.tensor(row_chunk, dtype=torch.int32, device=dev)
            q_pos = torch.tensor(positions, dtype=torch.int32, device=dev)
            native = []
            for group_tables in tables:
                width = max(len(t) for t in group_tables)
                native.append(NativeTables(torch.tensor([t + [0] * (width - len(t)) for t in group_tables],
                                                        dtype=torch.int32, device=dev), row_table, q_pos))
            attn = PagedAttention(self.storage, slot_mappings, self.scale, native, [], self.group_of_layer)
        else:
            attn = PagedAttention(self.storage, slot_mappings, self.scale, None,
                                  [self._torch_groups(out, t) for t in tables], self.group_of_layer)
        return StepInputs(
            torch.tensor(token_ids, device=dev), torch.tensor(positions, device=dev), attn,
            torch.tensor(last_rows, device=dev) if last_rows else None,
            torch.tensor(prompt_rows, device=dev) if prompt_rows else None, tuple(prompt_spans),
        )

    def _torch_groups(self, out: SchedulerOutput, tables: list[list[int]]) -> list[AttentionGroup]:
        """One group per chunk, decode rows included: a chunk attends over its own blocks alone, at
        a key count fixed by its own table. Batching decode rows into one bmm over padded tables
        let a row's bits depend on the others' lengths on some CPUs (oneDNN on AMX: 1 request in
        54 of the mixed workload in tests/engine/test_guarantee.py), so the torch path does not."""
        dev = self.device
        groups: list[AttentionGroup] = []
        row0 = 0
        for ch, table in zip(out.chunks, tables, strict=True):
            T = ch.num_new_tokens
            groups.append(self._group(
                torch.arange(row0, row0 + T, device=dev).view(1, T),
                torch.arange(ch.start, ch.start + T, device=dev).view(1, T),
                [table],
            ))
            row0 += T
        return groups
