"""Owns driving an engine through a workload: the one driver of the tests, `isolab selftest`, the
lifecycle demo and the doctor's in-process target.

    make_engine(bundle, kv_blocks, ...)    an engine whose pool has exactly kv_blocks usable blocks
    drive(engine, arrivals, ...) -> Run    arrivals at their steps (cancelled after some steps if
                                           asked), admission capped per step and by requests in
                                           flight; what each request produced
    run_alone(engine, arrivals)            each request alone, one after another: the reference
    torch_threads(n)                       a block run on n torch threads

Uses the engine's public API only (add_request / step / abort / has_unfinished), except
`check_invariants=True`, which asks the block pool to check itself after every step (white-box).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from isolab.sampling_params import SamplingParams

if TYPE_CHECKING:
    from isolab.engine.llm_engine import LLMEngine
    from isolab.errors import IsolabError
    from isolab.models.bundle import ModelBundle


@dataclass(frozen=True)
class Arrival:
    step: int  # the engine step at which it is sent
    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    scope: str | None = None
    cancel_after: int | None = None  # aborted this many steps after it was admitted (None: runs to its end)


@dataclass(frozen=True)
class Finished:
    """One request's result: its tokens, their logprobs (when asked for), and how it ended."""

    rid: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Any, ...]  # the engine's TokenLogprob per output token: token_id, logprob, top
    num_cached_tokens: int
    finish_reason: str | None
    error: IsolabError | None
    step: int  # the driver's step whose outputs ended it

    def pairs(self) -> tuple[tuple[int, float], ...]:
        """(token, logprob) at each output position: what a bit-for-bit comparison compares."""
        return tuple((lp.token_id, lp.logprob) for lp in self.logprobs)


@dataclass
class Run:
    finished: dict[str, Finished] = field(default_factory=dict)  # in the order they finished
    admitted: list[str] = field(default_factory=list)  # in the order they were admitted
    cancelled: list[str] = field(default_factory=list)  # aborted by their cancel_after
    invariant_breach: tuple[int, str] | None = None  # (step, message): the pool's invariant checker's first failure
    steps: int = 0

    def errors(self) -> list[tuple[str, IsolabError]]:
        """(request, error) for each request that ended with an error (an audit violation, say)."""
        return [(rid, f.error) for rid, f in self.finished.items() if f.error is not None]


def drive(engine: LLMEngine, arrivals: Iterable[Arrival], *, check_invariants: bool = False,
          max_in_flight: int | None = None, max_admit_per_step: int | None = None, max_steps: int = 100_000) -> Run:
    """Run `arrivals` to the end. Each step: admit, in order, the arrivals whose step has come (at
    most `max_admit_per_step`, while fewer than `max_in_flight` run), abort those whose cancel_after
    has elapsed, then engine.step()."""
    pending = sorted(arrivals, key=lambda a: a.step)  # stable: equal steps keep their order
    run = Run()
    in_flight: dict[str, tuple[Arrival, int]] = {}  # rid -> (arrival, the step it was admitted)
    lps: dict[str, list[Any]] = {}
    step = 0
    while pending or engine.has_unfinished():
        admitted_now = 0
        while (pending and pending[0].step <= step
               and (max_in_flight is None or len(in_flight) < max_in_flight)
               and (max_admit_per_step is None or admitted_now < max_admit_per_step)):
            a = pending.pop(0)
            engine.add_request(a.rid, list(a.prompt), a.params, a.scope)
            in_flight[a.rid] = (a, step)
            run.admitted.append(a.rid)
            lps[a.rid] = []
            admitted_now += 1
        for rid, (a, at) in list(in_flight.items()):
            if a.cancel_after is not None and step - at >= a.cancel_after:
                engine.abort(rid)
                del in_flight[rid]
                run.cancelled.append(rid)
        for o in engine.step():
            lps[o.request_id].extend(o.new_logprobs)
            if o.finished:
                in_flight.pop(o.request_id, None)
                run.finished[o.request_id] = Finished(o.request_id, tuple(o.output_token_ids), tuple(lps[o.request_id]),
                                                      o.num_cached_tokens, o.finish_reason, o.error, step)
        if check_invariants and run.invariant_breach is None:
            try:
                engine.pool.check_invariants()
            except AssertionError as exc:
                run.invariant_breach = (step, str(exc))  # the first breach only
        step += 1
        if step >= max_steps:
            raise AssertionError(f"the workload did not finish in {max_steps} steps")
    run.steps = step
    return run


def run_alone(engine: LLMEngine, arrivals: Iterable[Arrival]) -> dict[str, Finished]:
    """Each request alone (sent at step 0, never cancelled), one after another on `engine`: the
    reference a batched run is compared with. Give it an engine with the prefix cache off, so
    nothing of one request is seen by the next: then it is the same as a fresh engine per request."""
    out: dict[str, Finished] = {}
    for a in arrivals:
        out.update(drive(engine, [replace(a, step=0, cancel_after=None)]).finished)
    return out


def make_engine(bundle: ModelBundle, kv_blocks: int, *, block_size: int = 16, prefix: bool = True, max_seqs: int = 16,
                budget: int = 256, audit: bool = False, faults: frozenset[str] = frozenset(),
                trace_path: str | None = None, kv_cache_dtype: str = "auto") -> LLMEngine:
    """An engine on `bundle` whose pool has exactly `kv_blocks` usable blocks of `block_size` tokens
    (blocks of every layer: with Gemma 3's window cache the same memory is cut into smaller blocks
    of one KV group each, engine/kv_groups.py); `budget` is max_num_batched_tokens, `max_seqs`
    max_num_seqs; kv_cache_dtype "int8": the 8-bit pool."""
    import torch

    from isolab.config import CacheConfig, EngineConfig, SchedulerConfig
    from isolab.engine.kv_storage import kv_cache_memory_for
    from isolab.engine.llm_engine import LLMEngine

    kv_dtype = torch.int8 if kv_cache_dtype == "int8" else bundle.model.dtype
    memory = kv_cache_memory_for(bundle.hparams, block_size, kv_dtype, kv_blocks)
    cfg = EngineConfig(
        model=str(bundle.path), dtype=bundle.dtype,
        cache=CacheConfig(block_size, memory, prefix, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_seqs, budget), audit=audit, inject_faults=faults, trace_path=trace_path,
    )
    return LLMEngine(cfg, bundle)


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block on `n` torch (and native kernel) threads; None leaves torch's setting alone."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def solo_mismatches(bundle: ModelBundle, arrivals: list[Arrival], *, kv_blocks: int, max_seqs: int = 8) -> list[str]:
    """The requests whose tokens or logprobs differ between one batched run and each request alone
    (prefix cache off for the solo runs), on one torch thread: [] is the isolation guarantee."""
    with torch_threads(1):
        batched = drive(make_engine(bundle, kv_blocks, max_seqs=max_seqs), arrivals).finished
        alone = run_alone(make_engine(bundle, kv_blocks, prefix=False), arrivals)
    return [a.rid for a in arrivals if (batched[a.rid].token_ids, batched[a.rid].logprobs)
            != (alone[a.rid].token_ids, alone[a.rid].logprobs)]
