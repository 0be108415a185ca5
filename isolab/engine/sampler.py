"""Owns turning logits into tokens: greedy, temperature, top-k, top-p, per-request RNG, logprobs.

Each request samples with its own torch.Generator (claim C17: isolation at request granularity),
so what it draws never depends on other requests. Logprobs are the model's raw distribution
(log-softmax of the logits, before temperature and truncation), as OpenAI reports them.
"""

from __future__ import annotations

import torch

from isolab.engine.request import Request, TokenLogprob


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # fresh entropy
    else:
        g.manual_seed(seed)
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(V,) -> (V,) with excluded tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p (the first is always kept)
        drop = (torch.cumsum(probs, -1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, requests: list[Request], shared_generator: torch.Generator | None = None
) -> list[tuple[int, TokenLogprob | None]]:
    """logits (M, V) float32, one row per request -> one (token, logprob) per request.

    shared_generator is set only under the fault `shared-rng`: one generator for everyone.
    """
    out: list[tuple[int, TokenLogprob | None]] = []
    greedy_tokens = torch.argmax(logits, dim=-1).tolist() if logits.shape[0] else []
    for i, req in enumerate(requests):
        p = req.params
        row = logits[i]
        if p.greedy:
            token = int(greedy_tokens[i])
        else:
            filtered = _filter(row / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(filtered, -1)
            gen = shared_generator if shared_generator is not None else req.generator
            token = int(torch.multinomial(probs, 1, generator=gen).item())
        lp: TokenLogprob | None = None
        if p.logprobs is not None:
            logp = torch.log_softmax(row, -1)
            top: tuple[tuple[int, float], ...] = ()
            if p.logprobs > 0:
                vals, ids = torch.topk(logp, p.logprobs)
                top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
            lp = TokenLogprob(token, float(logp[token]), top)
        out.append((token, lp))
    return out
