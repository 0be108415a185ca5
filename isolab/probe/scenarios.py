"""Owns the probe's scenarios: the request sequences that expose each isolation failure, and which
verdict function judges each. The order of requests is the whole point of a scenario, so each one
writes its order down where it sends.

Scenarios share a Context: the client, the thresholds, the prompts, two identities (A and B), and
what calibration learnt (does the server report cached_tokens, does a fresh cache_salt give a
cold run). `cold(prompt)` is the reference run: under a fresh salt when the server honours salts
(then nothing cached can reach it), otherwise the first run, with a note.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from isolab.probe.client import Identity, ProbeClient
from isolab.probe.record import Completion
from isolab.probe.verdicts import (
    Comparison,
    Status,
    Thresholds,
    Verdict,
    combine,
    compare,
    foreign_canaries,
    judge_cached_bounds,
    judge_comparisons,
    judge_monitoring,
    judge_seeded,
    judge_tenants,
    judge_timing,
)
from isolab.probe.workload import Workload

MONITOR_PATHS = (
    "/metrics", "/health", "/slots", "/props", "/stats", "/debug", "/debug/requests", "/debug/vars",
    "/debug/pprof/", "/server_info", "/get_server_info", "/v1/metrics", "/requests", "/logs", "/version", "/info",
)


@dataclass
class Sizes:
    max_tokens: int = 16  # greedy outputs: long enough to diverge, short enough for a CPU server
    flood: int = 12  # concurrent background requests
    first_blocks: int = 64  # novel prompts for the colliding-keys check (8-bit keys: ~8 expected collisions)
    timing_samples: int = 0  # TTFT samples per group; 0 = the timing test is off (opt-in)


@dataclass
class Context:
    client: ProbeClient
    th: Thresholds
    sizes: Sizes
    work: Workload
    a: Identity
    b: Identity
    tenants_how: str  # "api keys" or "cache_salt"
    salt_identities: tuple[Identity, Identity] | None = None  # a second tenant test inside key A, when keys are given
    reports_cached: bool = False
    salt_cold: bool = False  # a fresh cache_salt gives a cold run (calibrated)
    records: list[Completion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_request: Callable[[], None] = lambda: None

    async def send(self, prompt: str, who: Identity | None = None, *, tags: tuple[str, ...] = (), **kw) -> Completion:
        kw.setdefault("max_tokens", self.sizes.max_tokens)
        rec = await self.client.complete(prompt, who or self.a, tags=tags, **kw)
        self.records.append(rec)
        self.on_request()
        return rec

    async def cold(self, prompt: str, *, tags: tuple[str, ...] = (), **kw) -> Completion:
        """The reference run of `prompt`: under a fresh salt when salts give cold runs."""
        who = Identity(self.a.label, self.a.api_key, f"probe-cold-{self.work.word(8)}") if self.salt_cold else self.a
        return await self.send(prompt, who, tags=("reference", *tags), **kw)

    async def gather(self, coros: Sequence[Awaitable[Completion]]) -> list[Completion]:
        return list(await asyncio.gather(*coros))


def _failed(name: str, recs: list[Completion]) -> Verdict | None:
    bad = [r for r in recs if not r.ok]
    if not bad:
        return None
    return Verdict(name, Status.INCONCLUSIVE, f"{len(bad)} request(s) failed, first: HTTP {bad[0].status} {bad[0].error}")


async def _first_token(started: asyncio.Event, job: asyncio.Future) -> None:
    """Until a streamed request has its first token (or has ended, e.g. refused)."""
    waiter = asyncio.ensure_future(started.wait())
    await asyncio.wait({waiter, job}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


# -- calibration ----------------------------------------------------------------------------------------
async def calibrate(ctx: Context) -> list[str]:
    """Learn what the server reports. Order: P, P (hit?), P under a fresh salt (cold?)."""
    p = ctx.work.plain(6)
    first = await ctx.send(p, tags=("calibration",), max_tokens=1)
    if not first.ok:
        got = f"HTTP {first.status}: {first.error}" if first.status else f"no answer ({first.error})"
        return [f"the first completion failed: {got}"]
    again = await ctx.send(p, tags=("calibration",), max_tokens=1)
    salted = await ctx.send(p, Identity(ctx.a.label, ctx.a.api_key, f"probe-cal-{ctx.work.word(8)}"),
                            tags=("calibration",), max_tokens=1)
    ctx.reports_cached = again.cached_tokens is not None
    caps = ctx.client.caps
    ctx.salt_cold = bool(ctx.reports_cached and caps.cache_salt and (again.cached_tokens or 0) > 0
                         and salted.cached_tokens == 0)
    notes = [f"logprobs: {'yes' if first.has_logprobs else 'no (differences cannot be told from batch variance)'}",
             f"cached_tokens reported: {'yes' if ctx.reports_cached else 'no'}"
             + (f" (a repeat hit {again.cached_tokens})" if ctx.reports_cached else ""),
             f"fresh cache_salt gives a cold run: {'yes' if ctx.salt_cold else 'no: references are first runs'}"]
    notes += [f"dropped field {d}" for d in caps.dropped]
    if ctx.tenants_how == "api keys" and ctx.salt_identities is not None:
        # Keys name tenants only on a server that checks them: one that serves a made-up key (no auth)
        # puts both keys in one tenant, and their sharing would read as a leak.
        made_up = Identity("made-up key", f"isolab-probe-not-a-key-{ctx.work.word(12)}")
        if (await ctx.send(p, made_up, tags=("calibration",), max_tokens=1)).ok:
            notes.append("the server served a made-up API key (no authentication): the two keys name no tenants, "
                         "so the tenant test uses two cache_salt values instead")
            ctx.a, ctx.b = ctx.salt_identities
            ctx.tenants_how, ctx.salt_identities = "cache_salt", None
    ctx.notes += notes
    return []


# -- 1. concurrency invariance --------------------------------------------------------------------------
async def concurrency(ctx: Context) -> Verdict:
    """Targets alone, one by one; then the same targets inside a flood of other canary prompts."""
    w, n = ctx.work, ctx.sizes
    targets = [w.secret(2 + i) for i in range(4)]
    alone = [await ctx.send(p, tags=("alone",)) for p, _ in targets]
    flood = [w.secret(1 + i % 5) for i in range(n.flood)]
    flood_jobs = [ctx.send(p, tags=("flood",), max_tokens=n.max_tokens + 8 * (i % 3)) for i, (p, _) in enumerate(flood)]
    loaded = await ctx.gather(flood_jobs[: n.flood // 2] + [ctx.send(p, tags=("loaded",)) for p, _ in targets]
                              + flood_jobs[n.flood // 2 :])
    loaded_targets = loaded[n.flood // 2 : n.flood // 2 + len(targets)]
    flood_out = loaded[: n.flood // 2] + loaded[n.flood // 2 + len(targets) :]
    if (bad := _failed("concurrency", alone + loaded)) is not None:
        return combine("concurrency", [bad])
    canaries = [c for _, c in targets + flood]
    comps = [compare(a, b, canaries=canaries, th=ctx.th, label=f"target {i} alone vs under load")
             for i, (a, b) in enumerate(zip(alone, loaded_targets, strict=True))]
    comps += [Comparison(f"flood {i}", "contamination", reason=f"another request's canary {leak[0]!r} in the output")
              for i, r in enumerate(flood_out) if (leak := foreign_canaries(r, canaries))]
    return combine("concurrency", [judge_comparisons("alone vs under load", comps, "greedy runs")])


# -- 2. prefix-cache correctness ------------------------------------------------------------------------
async def prefix_cache(ctx: Context) -> Verdict:
    w, parts = ctx.work, []
    # a. Cold vs warm over shared prefixes of several lengths. Order: every reference, then A_L, B_L
    #    (B_L's prefix now warm), then A_L, B_L again (fully warm).
    doc, canary = w.secret(8)
    cuts = [cut for cut in (len(doc) // 4, len(doc) // 2, len(doc)) for _ in range(2)]
    prompts = [doc[:cut] + suffix for cut, suffix in zip(cuts, (" First,", " Second,") * 3, strict=True)]
    short = max(4, ctx.sizes.max_tokens // 2)  # a wrong prefix shows in the first tokens
    refs = await ctx.gather([ctx.cold(p, max_tokens=short) for p in prompts])  # each under its own salt
    first = [await ctx.send(p, tags=("warm",), max_tokens=short) for p in prompts]
    second = await ctx.gather([ctx.send(p, tags=("warm",), max_tokens=short) for p in prompts])
    comps = [compare(r, x, canaries=w.canaries, th=ctx.th, label=f"{cut}-character shared prefix, warm run {k}")
             for k, runs in ((1, first), (2, second)) for cut, r, x in zip(cuts, refs, runs, strict=True)]
    v = judge_comparisons("cold vs warm", comps, "cold/warm pairs")
    hits = [r.cached_tokens for r in second if r.cached_tokens]
    if ctx.reports_cached and not hits and v.status is Status.PASS:
        v = Verdict(v.name, Status.INCONCLUSIVE, "no cache hit was ever reported: the prefix cache looks off, so cold "
                    "and warm are the same path", v.evidence, v.data)
    parts.append(v)

    # b. Different prompts of equal length, and c. prompts one character apart inside the first block.
    #    Order: every Y's reference, then per pair X (one token: it only fills the cache), then Y.
    pairs = [w.same_length_pair(2 + i) for i in range(2)]
    for pos in (12, 40):
        x, c = w.secret(3)
        pairs.append(((x, c), (w.one_char_off(x, pos), c)))
    comps = []
    pair_refs = await ctx.gather([ctx.cold(y, max_tokens=short) for _, (y, _) in pairs])
    for i, (((x, _), (y, _)), ref) in enumerate(zip(pairs, pair_refs, strict=True)):
        await ctx.send(x, tags=("pair-first",), max_tokens=1)
        got = await ctx.send(y, tags=("pair-second",), max_tokens=short)
        kind = "equal length" if i < 2 else "one character apart"
        comps.append(compare(ref, got, canaries=w.canaries, th=ctx.th, label=f"{kind} pair {i}: second prompt cold vs after the first"))
    parts.append(judge_comparisons("similar prompts", comps, "pairs"))

    # d. Many novel first blocks (a weak key collides among a few hundred), in waves of 16.
    novel = [w.plain(2) for _ in range(ctx.sizes.first_blocks)]
    for i in range(0, len(novel), 16):
        await ctx.gather([ctx.send(p, tags=("novel",), max_tokens=1) for p in novel[i : i + 16]])

    # e. A prompt that extends another request's prompt while that request still decodes: Y is X,
    #    then the next k tokens X will generate (known from X's reference run), then other text, so
    #    the block X is writing is a prefix of Y's. Y goes out as soon as X has streamed m tokens,
    #    with k = m + a few (X must not be past k when Y arrives), under three offsets.
    comps = []
    for offset in (2, 4, 6):
        x, _c = w.secret(3)
        ref_x = await ctx.cold(x, max_tokens=2 * ctx.sizes.max_tokens)
        ref_units = ref_x.units()
        seen: list[int] = []
        started = asyncio.Event()

        def progress(n: int, seen: list[int] = seen, started: asyncio.Event = started) -> None:
            seen.append(n)
            started.set()

        job = asyncio.ensure_future(ctx.client.complete(x, ctx.a, max_tokens=2 * ctx.sizes.max_tokens, stream=True,
                                                        tags=("extended",), on_progress=progress))
        await _first_token(started, job)
        y = x + "".join(ref_units[: (seen[0] if seen else 0) + offset]) + " " + w.filler(1)
        got_y = await ctx.send(y, tags=("extension",), max_tokens=2 * ctx.sizes.max_tokens)
        ref_y = await ctx.cold(y, max_tokens=2 * ctx.sizes.max_tokens)
        got_x = await job
        ctx.records.append(got_x)
        ctx.on_request()
        comps.append(compare(ref_x, got_x, canaries=w.canaries, th=ctx.th, label="running request, extended by another"))
        comps.append(compare(ref_y, got_y, canaries=w.canaries, th=ctx.th, label="extension of a running request"))
    parts.append(judge_comparisons("extend while decoding", comps, "runs"))

    # The bound over everything sent so far (cached_tokens <= what a prompt shares with earlier ones).
    order = sorted((r for r in ctx.records if r.ok), key=lambda r: r.sent_at or 0.0)
    parts.append(judge_cached_bounds("no false hits", order, ctx.th))
    return combine("prefix-cache", parts)


# -- 3. reuse staleness ---------------------------------------------------------------------------------
async def reuse(ctx: Context) -> Verdict:
    w, n, parts = ctx.work, ctx.sizes, []
    # a. Sequence: S (reference), then L_i (a canary prompt), S, L_{i+1}, S, ...
    short = w.plain(1) + " Question: what is two plus two? Answer:"
    ref = await ctx.send(short, tags=("short-ref",))
    comps = []
    for i in range(3):
        long_rec = await ctx.send(w.secret(4 + i)[0], tags=("long",), max_tokens=4)
        got = await ctx.send(short, tags=("short",))
        comps.append(compare(ref, got, canaries=w.canaries, th=ctx.th, label=f"short prompt after canary prompt {i}"))
        if leak := foreign_canaries(long_rec, w.canaries):
            comps.append(Comparison(f"canary prompt {i}", "contamination", reason=f"an earlier canary {leak[0]!r} in the output"))
    parts.append(judge_comparisons("sequential reuse", comps, "runs"))

    # b. Evict and re-hit: A cached; a flood of short prompts that decode long (each writing into
    #    fresh tail blocks); A asked again while the flood runs, at growing gaps (asked every 0.1 s,
    #    A stayed the most recently used prompt, and an LRU cache never let it go), and once after.
    a, _ = w.secret(1)
    a_tokens = max(4, n.max_tokens // 2)
    a_ref = await ctx.send(a, tags=("evict-ref",), max_tokens=a_tokens)
    flood = [ctx.send(w.plain(0), tags=("pressure",), max_tokens=3 * n.max_tokens, stream=True) for _ in range(n.flood)]
    flood_job = asyncio.ensure_future(asyncio.gather(*flood))
    reruns = []
    gap = 0.1
    for _ in range(6):
        await asyncio.sleep(gap)
        if flood_job.done():
            break
        reruns.append(await ctx.send(a, tags=("evict-rerun",), max_tokens=a_tokens))
        gap *= 2
    await flood_job
    reruns.append(await ctx.send(a, tags=("evict-rerun",), max_tokens=a_tokens))  # after it all
    comps = [compare(a_ref, r, canaries=w.canaries, th=ctx.th, label=f"re-request {i} of a cached prompt under pressure")
             for i, r in enumerate(reruns)]
    v = judge_comparisons("evict and re-hit", comps, "re-requests")
    evicted = sum(1 for r in reruns if r.cached_tokens == 0)
    v.data["num_evicted"] = evicted
    if v.status is Status.PASS:
        if ctx.reports_cached and evicted == 0:
            v = Verdict(v.name, Status.INCONCLUSIVE, "no eviction observed: the flood did not put this server's KV cache "
                        "under pressure, so reuse after eviction went untested", v.evidence, v.data, optional=True)
        else:
            v.summary += f" ({evicted} of {len(reruns)} re-requests found the prompt evicted)"
    parts.append(v)
    return combine("reuse", parts)


# -- 4. tenant isolation ----------------------------------------------------------------------------------
async def _tenant_pair(ctx: Context, a: Identity, b: Identity, how: str) -> list[Verdict]:
    """Order: A (cold), A again (the positive control), B; the same for a longer prompt."""
    out = []
    for n_sentences in (3, 8):
        p, _ = ctx.work.secret(n_sentences)
        cold = await ctx.send(p, a, tags=("tenant-owner",), max_tokens=4)
        warm = await ctx.send(p, a, tags=("tenant-owner",), max_tokens=4)
        other = await ctx.send(p, b, tags=("tenant-other",), max_tokens=4)
        out.append(judge_tenants(cold, warm, [other], ctx.th, how=how))
    return out


async def tenants(ctx: Context) -> Verdict:
    parts = await _tenant_pair(ctx, ctx.a, ctx.b, ctx.tenants_how)
    if ctx.salt_identities is not None:
        parts += await _tenant_pair(ctx, *ctx.salt_identities, "cache_salt")
    if ctx.sizes.timing_samples > 0:
        parts.append(await timing(ctx))
    return combine("tenants", parts)


async def timing(ctx: Context) -> Verdict:
    """Per sample, with fresh long prompts X and Y of equal length: A sends X (now cached for A);
    then in random order: A sends X (own hit), B sends X (other tenant's prefix), B sends Y (never cached)."""
    w, a, b = ctx.work, ctx.a, ctx.b
    own: list[float] = []
    other: list[float] = []
    miss: list[float] = []
    for _ in range(ctx.sizes.timing_samples):
        text = w.filler(10)
        x, y = f"{w.word().capitalize()} report. {text}", f"{w.word().capitalize()} report. {text}"
        await ctx.send(x, a, tags=("timing-seed",), max_tokens=1)
        jobs = [("own", x, a), ("other", x, b), ("miss", y, b)]
        w.rng.shuffle(jobs)
        for kind, prompt, who in jobs:
            r = await ctx.send(prompt, who, tags=(f"timing-{kind}",), max_tokens=1, stream=True)
            if r.ok and r.ttft_s is not None:
                {"own": own, "other": other, "miss": miss}[kind].append(r.ttft_s)
    return judge_timing(own, other, miss, ctx.th.alpha)


# -- 5. seeded sampling -------------------------------------------------------------------------------------
async def seeded(ctx: Context) -> Verdict:
    """Each seeded prompt alone twice, then all of them inside a flood of other sampling requests."""
    w, n = ctx.work, ctx.sizes
    jobs = [(w.plain(2), 1000 + 17 * i) for i in range(3)]
    alone = []
    for p, s in jobs:
        alone.append((await ctx.send(p, tags=("seeded-alone",), temperature=1.0, seed=s),
                      await ctx.send(p, tags=("seeded-alone",), temperature=1.0, seed=s)))
    flood = [ctx.send(w.plain(1), tags=("flood",), temperature=1.0, seed=(None if i % 2 else 7 + i),
                      max_tokens=n.max_tokens + 4 * (i % 3)) for i in range(n.flood)]
    res = await ctx.gather(flood[: n.flood // 2] + [ctx.send(p, tags=("seeded-loaded",), temperature=1.0, seed=s)
                                                    for p, s in jobs] + flood[n.flood // 2 :])
    loaded = res[n.flood // 2 : n.flood // 2 + len(jobs)]
    if not ctx.client.caps.seed:
        return combine("seeded", [Verdict("seeded sampling", Status.INCONCLUSIVE, "the server refused the seed field")])
    return combine("seeded", [judge_seeded(alone, loaded, ctx.th)])


# -- 6. content in monitoring -------------------------------------------------------------------------------
async def monitoring(ctx: Context) -> Verdict:
    """Unauthenticated GETs while a canary request is in flight, and again after it."""
    p, c = ctx.work.secret(4)
    started = asyncio.Event()
    job = asyncio.ensure_future(ctx.client.complete(p, ctx.a, max_tokens=2 * ctx.sizes.max_tokens, stream=True,
                                                    tags=("monitored",), on_progress=lambda n: started.set()))
    await _first_token(started, job)
    during = [(path, *(await ctx.client.get_raw(path))) for path in MONITOR_PATHS]
    ctx.records.append(await job)
    ctx.on_request()
    after = [(path, *(await ctx.client.get_raw(path))) for path in MONITOR_PATHS]
    secrets = list(ctx.work.canaries) + [r.prompt[:32] for r in ctx.records if len(r.prompt) >= 32]
    return combine("monitoring", [judge_monitoring(during + after, secrets)])


SCENARIOS: dict[str, Callable[[Context], Awaitable[Verdict]]] = {
    "concurrency": concurrency,
    "prefix-cache": prefix_cache,
    "reuse": reuse,
    "tenants": tenants,
    "seeded": seeded,
    "monitoring": monitoring,
}
