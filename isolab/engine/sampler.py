"""Owns turning logits into tokens: greedy, temperature, top-k, top-p, per-request RNG, logprobs.

Each request samples with its own torch.Generator (claim C17: isolation at request granularity),
so what it draws never depends on other requests. Logprobs are the model's raw distribution
(log-softmax of the logits, before temperature and truncation), as OpenAI reports them.
"""

from __future__ import annotations

import torch

from isolab import kernels
from isolab.engine.request import Request, TokenLogprob
from isolab.engine.step import NOT_FINITE


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # fresh entropy
    else:
        g.manual_seed(seed)
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """(V,) -> (V,) with excluded tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p (the first is always kept)
        drop = (torch.cumsum(probs, -1) - probs) >= top_p
        drop[0] = False  # even when top_p rounds to 0 in float32 (a top_p of 1e-308 dropped every token)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def process_logits(logits: torch.Tensor, requests: list[Request], eos_token_id: int | None,
                   end_of_turn: frozenset[int] = frozenset()) -> torch.Tensor:
    """(M, V) raw logits -> (M, V) with each asking row's penalties, bias and min_tokens applied.

    Rows that ask for nothing are the input's rows, untouched. For the others, in this order (as
    vLLM): repetition penalty over prompt + output tokens, frequency and presence penalties over
    output tokens, logit_bias, then min_tokens masks EOS, the end-of-turn tokens that stop a request
    as EOS does (Gemma's <end_of_turn>: engine/stop.py) and the stop tokens, and last the
    request's grammar (structured outputs) masks what its own matcher forbids. Each is elementwise
    in its row, so a row's result never depends on the others (batch invariance holds). One
    tensor op per rule for all asking rows; the Python work is building the index lists.
    """
    idx = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not idx:
        return logits
    reqs = [requests[i] for i in idx]
    sub = logits[idx]  # (B, V), a copy
    B, V = sub.shape
    dev = sub.device

    def rows_and_tokens(token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [b for b, toks in enumerate(token_lists) for _ in toks]
        flat = [t for toks in token_lists for t in toks]
        return torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(flat, dtype=torch.long, device=dev)

    rep = torch.tensor([r.params.repetition_penalty for r in reqs], device=dev).unsqueeze(1)  # (B, 1)
    if bool((rep != 1.0).any()):
        rows, toks = rows_and_tokens([r.token_ids if r.params.repetition_penalty != 1.0 else [] for r in reqs])
        seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        seen[rows, toks] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([r.params.frequency_penalty for r in reqs], device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in reqs], device=dev).unsqueeze(1)
    if bool((freq != 0).any() or (pres != 0).any()):
        rows, toks = rows_and_tokens([r.output_token_ids for r in reqs])
        counts = torch.zeros(B, V, device=dev)
        counts.index_put_((rows, toks), torch.ones_like(rows, dtype=counts.dtype), accumulate=True)  # exact: integers
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    if any(r.params.logit_bias for r in reqs):
        biases = [dict(r.params.logit_bias) for r in reqs]
        rows, toks = rows_and_tokens([[t for t in b if t < V] for b in biases])
        vals = torch.tensor([b[t] for b in biases for t in b if t < V], dtype=sub.dtype, device=dev)
        sub[rows, toks] += vals  # one entry per (row, token): no accumulation order to fix
    ends = ([eos_token_id] if eos_token_id is not None else []) + sorted(end_of_turn)
    banned = [ends + list(r.params.stop_token_ids) if len(r.output_token_ids) < r.params.min_tokens else [] for r in reqs]
    grammar_rows = [b for b, r in enumerate(reqs) if r.matcher is not None]
    # (B,): a NaN that the masks below would cover with -inf still fails its row (checked only where one applies:
    # elsewhere the argmax or the softmax meets the NaN)
    broken = torch.isnan(sub).any(dim=-1) if any(banned) or grammar_rows else None
    if any(banned):
        rows, toks = rows_and_tokens([[t for t in b if t < V] for b in banned])
        sub[rows, toks] = float("-inf")
    dead = torch.isneginf(sub).all(dim=-1)  # every token masked (stop_token_ids naming the vocabulary):
    if bool(dead.any()):  # the request asked for the impossible; it samples from its raw row instead
        sub[dead] = logits[idx][dead]
    if grammar_rows:  # last: nothing above may let a token through that the grammar forbids
        sub[grammar_rows] = _grammar_mask(sub[grammar_rows], [reqs[b].matcher for b in grammar_rows], eos_token_id)
    if broken is not None and bool(broken.any()):  # (the mask had hidden it: the row sampled on as if sound)
        sub[broken] = float("nan")
    out = logits.clone()
    out[idx] = sub
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """(M, V) -> (M,) int64, torch.argmax(x, dim=-1): the native kernel where it runs (the same
    answer, several times faster over a vocabulary), else torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.stride(-1) == 1 \
            and x.shape[-1] > 0 and kernels.native_ready():
        return kernels.argmax_rows(x)
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        x = x.float()  # torch's CPU argmax is several times slower on bf16 than on fp32
    return torch.argmax(x, dim=-1)


_BIT = torch.arange(32, dtype=torch.int32)  # bit i of a 32-bit word: token 32 * word + i


def _grammar_mask(rows: torch.Tensor, matchers: list, eos_token_id: int | None) -> torch.Tensor:
    """(G, V) -> (G, V): each row's tokens that its own matcher forbids at -inf (row i, matcher i only).

    llguidance fills one 32-bit word per 32 tokens; the words are unpacked here with plain tensor
    ops (llguidance.torch's own apply compiles a TorchScript kernel on first use, 1.5 s).
    """
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    G, V = rows.shape
    words = allocate_token_bitmask(G, V)  # (G, ceil(V / 32)) int32
    for i, m in enumerate(matchers):
        fill_next_token_bitmask(m, words, i)
    allowed = ((words.unsqueeze(-1) >> _BIT.to(words.device)) & 1).view(G, -1)[:, :V].bool()  # (G, V)
    rows = rows.masked_fill(~allowed.to(rows.device), float("-inf"))
    dead = torch.isneginf(rows).all(dim=-1)  # a matcher in error allows nothing: end the row with EOS
    if bool(dead.any()) and eos_token_id is not None and eos_token_id < V:
        rows[dead, eos_token_id] = 0.0
    return rows


def sample(
    logits: torch.Tensor, requests: list[Request], shared_generator: torch.Generator | None = None,
    eos_token_id: int | None = None, end_of_turn: frozenset[int] = frozenset(),
) -> list[tuple[int, TokenLogprob | None]]:
    """logits (M, V) bf16 or float32, one row per request -> one (token, logprob) per request.

    The token comes from the processed logits (process_logits); logprobs from the raw ones. Logits
    are widened to float32 first unless every request only takes the argmax (greedy, nothing to
    apply, no logprobs): bf16 -> fp32 is exact, so the argmax is the same either way.
    shared_generator is set only under the fault `shared-rng`: one generator for everyone.
    """
    M = logits.shape[0]
    if M == 0:
        return []
    if not all(r.params.greedy and not r.params.processes_logits and r.params.logprobs is None for r in requests):
        logits = logits.float()
    chosen = process_logits(logits, requests, eos_token_id, end_of_turn)
    top = argmax_rows(chosen)  # (M,)
    nan = torch.isnan(chosen.gather(1, top.unsqueeze(1))).squeeze(1)  # (M,): a NaN row's argmax is NaN
    tokens: list[int] = top.tolist()
    for i, req in enumerate(requests):
        p = req.params
        if not p.greedy:
            filtered = _filter(chosen[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = torch.softmax(filtered, -1)
            gen = shared_generator if shared_generator is not None else req.generator
            try:
                tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
            except RuntimeError:  # "probability tensor contains either inf, nan or element < 0"
                tokens[i] = NOT_FINITE
    if bool(nan.any()):
        tokens = [NOT_FINITE if bad else t for t, bad in zip(tokens, nan.tolist(), strict=True)]
    lps: list[TokenLogprob | None] = [None] * M
    lp_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if lp_rows:
        logp = torch.log_softmax(logits[lp_rows], -1)  # (B, V): each row reduced on its own
        tops = top_logprobs(logp, [requests[i].params.logprobs or 0 for i in lp_rows])
        picked = logp[torch.arange(len(lp_rows)), torch.tensor([max(tokens[i], 0) for i in lp_rows])].tolist()
        for b, i in enumerate(lp_rows):
            lps[i] = TokenLogprob(tokens[i], float(picked[b]), tops[b]) if tokens[i] != NOT_FINITE else None
    return list(zip(tokens, lps, strict=True))


def top_logprobs(logp: torch.Tensor, ns: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Row b's ns[b] most likely tokens of logp (B, V), as (token, logprob) from the most likely: ties
    go to the smaller token id, so a row's list depends on that row and its own n alone. (torch.topk
    orders tied values by its k: cut from the step's largest n, a request's list changed with what
    another request in its step asked for; bf16 logits tie often.)"""
    out: list[tuple[tuple[int, float], ...]] = [()] * len(ns)
    k = max(ns, default=0)
    if not k:
        return out
    width = min(k + 1, logp.shape[-1])  # one past the largest n: shows whether a run of ties goes on
    top_v, top_i = torch.topk(logp, width)  # its values are the same whatever the ties; its indices are not
    values, ids = top_v.tolist(), top_i.tolist()
    for b, n in enumerate(ns):
        if not n:
            continue
        cut = values[b][n - 1]
        if width == logp.shape[-1] or values[b][width - 1] < cut:  # every token of the cut's value is here
            out[b] = tuple(sorted(zip(ids[b], values[b], strict=True), key=lambda t: (-t[1], t[0]))[:n])
            continue
        row = logp[b]  # a run of ties past the width (or NaN): search the row
        above = (row > cut).nonzero().flatten()  # fewer than n, in id order
        found = torch.cat([above, (row == cut).nonzero().flatten()[: n - above.numel()]])
        if found.numel() < n:  # a row of NaN (nothing compares): topk's own order, as before
            found = top_i[b, :n]
        vals = row[found]
        order = torch.sort(-vals, stable=True).indices  # most likely first; equal values keep id order
        out[b] = tuple(zip(found[order].tolist(), vals[order].tolist(), strict=True))
    return out
