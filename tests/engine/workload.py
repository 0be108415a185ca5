"""The random mixed workload of the isolation guarantee tests (random arrivals, shared prefixes,
cancellations), run by isolab.testing.workload's driver, and the solo reference it is compared with."""

from __future__ import annotations

import random

from isolab.engine.llm_engine import empty_cache_check
from isolab.sampling_params import SamplingParams
from isolab.testing.workload import Arrival, Finished, drive, make_engine, run_alone, torch_threads


def make_specs(n: int, vocab: int, seed: int, *, max_prompt: int = 80, max_new: int = 24, cancel_share: float = 0.1,
               spread: int = 40, lo: int = 3) -> list[Arrival]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(lo, vocab) for _ in range(rng.choice([16, 32, 40]))) for _ in range(4)]
    specs = []
    for i in range(n):
        body = tuple(rng.randrange(lo, vocab) for _ in range(rng.randint(1, max_prompt)))
        prompt = (prefixes[rng.randrange(4)] + body) if rng.random() < 0.5 else body
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0.0, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0.9, top_p=0.9, top_k=rng.choice([0, 20]),
                                    seed=rng.randrange(1 << 30), logprobs=2, ignore_eos=True)
        cancel = rng.randint(1, 10) if rng.random() < cancel_share else None  # steps after arrival
        step = rng.randint(0, spread)
        specs.append(Arrival(step, f"r{i}", prompt, params, cancel_after=cancel))
    return specs


def run_mixed(eng, specs: list[Arrival]) -> dict[str, Finished]:  # noqa: ANN001
    """Run specs with their arrivals and cancellations; the requests that ran to their end (none of
    them with an error), and the idle engine must hold no block afterwards."""
    run = drive(eng, specs)
    assert not run.errors(), run.errors()
    empty_cache_check(eng)
    return {rid: f for rid, f in run.finished.items() if rid not in run.cancelled}


def run_solo(bundle, specs: list[Arrival], *, threads: int | None = 1) -> dict[str, Finished]:  # noqa: ANN001
    """The reference: each request alone, one after another, in an engine with no prefix cache, on
    `threads` torch threads (None: torch's default). One thread by default: a row's bits do not
    depend on the thread count (each is computed in an order fixed by that row alone), and on cores
    shared with other jobs one thread is many times faster for the tiny model."""
    with torch_threads(threads):
        eng = make_engine(bundle, 64, prefix=False, max_seqs=32, budget=128)
        return run_alone(eng, specs)


def assert_hit_equals_miss(bundle, n: int = 30, seed: int = 11) -> None:  # noqa: ANN001
    """n requests, then the same n again on the same engine: the second time from the prefix cache,
    with the same tokens and logprobs as the first (a hit restores exactly what a miss computed)."""
    from dataclasses import replace

    specs = make_specs(n, bundle.hparams.vocab_size, seed=seed, cancel_share=0.0, spread=0)
    eng = make_engine(bundle, 400, max_seqs=32, budget=128)
    cold = run_mixed(eng, specs)
    warm = run_mixed(eng, [replace(s, step=0, cancel_after=None) for s in specs])
    assert sum(w.num_cached_tokens for w in warm.values()) > 0
    for s in specs:
        assert (warm[s.rid].token_ids, warm[s.rid].logprobs) == (cold[s.rid].token_ids, cold[s.rid].logprobs)
