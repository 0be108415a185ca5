"""Owns one probe run: ProbeConfig -> calibration -> the chosen scenarios in order -> ProbeResult.

Knows neither the command line nor the report formats; the progress callback is the only output.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from isolab.base_url import check_base_url
from isolab.probe.client import Identity, ProbeClient, ProbeUsageError
from isolab.probe.record import Completion
from isolab.probe.scenarios import SCENARIOS, Context, Sizes, calibrate
from isolab.probe.verdicts import Status, Thresholds, Verdict
from isolab.probe.workload import Workload

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3


@dataclass(frozen=True)
class ProbeConfig:
    base_url: str
    api_keys: tuple[str, ...] = ()  # two or more: tenants are keys; fewer: tenants are cache_salt values
    model: str | None = None
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    sizes: Sizes = field(default_factory=Sizes)
    thresholds: Thresholds = field(default_factory=Thresholds)
    seed: int | None = None  # the probe's own randomness (prompts, canaries); None: fresh each run
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        try:
            check_base_url(self.base_url)
        except ValueError as exc:
            raise ProbeUsageError(str(exc)) from None
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ProbeUsageError(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
        # the one place the probe's numbers are checked (the CLI and the library alike); NaN fails
        # every test (`nan > 0` is False)
        if len(self.api_keys) > 2:
            raise ProbeUsageError(f"--api-key given {len(self.api_keys)} times: give one key, or two for two tenants "
                                  "(a third would not be read)")
        if len(set(self.api_keys)) < len(self.api_keys):
            raise ProbeUsageError("the two --api-key values are the same key: give two tenants' keys, or one")
        if self.sizes.max_tokens < 2 or self.sizes.flood < 1:
            raise ProbeUsageError("--max-tokens must be at least 2 and --flood at least 1")
        if self.sizes.timing_samples != 0 and not self.sizes.timing_samples >= 5:
            raise ProbeUsageError(f"--timing takes at least 5 samples per group (the KS test needs 5), not "
                                  f"{self.sizes.timing_samples}; leave it out to skip the timing test")
        if self.sizes.first_blocks < 0:
            raise ProbeUsageError(f"--first-blocks must be 0 or more, not {self.sizes.first_blocks}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ProbeUsageError(f"--timeout must be a positive number of seconds, not {self.timeout_s}")


@dataclass
class ProbeResult:
    base_url: str
    model: str
    started: str  # ISO time
    seconds: float
    verdicts: list[Verdict]
    records: list[Completion]
    notes: list[str]
    durations: dict[str, float]  # scenario -> seconds
    settings: dict[str, Any]

    @property
    def exit_code(self) -> int:
        if any(v.status is Status.FAIL for v in self.verdicts):
            return EXIT_FAIL
        if any(v.status is Status.INCONCLUSIVE for v in self.verdicts):
            return EXIT_INCONCLUSIVE
        return EXIT_PASS


def estimate_requests(cfg: ProbeConfig, salt_too: bool) -> int:
    s = cfg.sizes
    per = {"concurrency": 8 + s.flood, "prefix-cache": 18 + 12 + s.first_blocks + 12, "reuse": 8 + s.flood + 7,
           "tenants": 6 * (2 if salt_too else 1) + 4 * s.timing_samples, "seeded": 9 + s.flood, "monitoring": 1}
    return 3 + (1 if salt_too else 0) + sum(per[n] for n in cfg.scenarios)  # (calibration: 3, a made-up key)


def identities(keys: tuple[str, ...], salt_word: str) -> tuple[Identity, Identity, str, tuple[Identity, Identity] | None]:
    """Tenant A and B: two API keys if given, else two cache_salt values under the one key."""
    first = keys[0] if keys else None
    salts = (Identity("A/salt-1", first, f"probe-a-{salt_word}"), Identity("A/salt-2", first, f"probe-b-{salt_word}"))
    if len(keys) >= 2:
        return Identity("A", keys[0]), Identity("B", keys[1]), "api keys", salts
    return salts[0], salts[1], "cache_salt", None


async def run_probe(cfg: ProbeConfig, *, on_request: Callable[[], None] = lambda: None,
                    on_scenario: Callable[[str], None] = lambda name: None,
                    transport: httpx.AsyncBaseTransport | None = None) -> ProbeResult:
    client = ProbeClient(cfg.base_url, model=cfg.model, timeout_s=cfg.timeout_s, transport=transport)
    work = Workload(cfg.seed)
    a, b, how, salt_pair = identities(cfg.api_keys, work.word(8))
    ctx = Context(client, cfg.thresholds, cfg.sizes, work, a, b, how, salt_pair, on_request=on_request)
    started, t0 = datetime.now(UTC).isoformat(timespec="seconds"), time.monotonic()
    durations: dict[str, float] = {}
    verdicts: list[Verdict] = []
    try:
        await client.discover(Identity("discover", a.api_key))
        on_scenario("calibration")
        problems = await calibrate(ctx)
        if problems:
            raise ProbeUsageError(f"the server at {client.base_v1} cannot be probed: {problems[0]}")
        for name in cfg.scenarios:
            on_scenario(name)
            t = time.monotonic()
            verdicts.append(await SCENARIOS[name](ctx))
            durations[name] = round(time.monotonic() - t, 2)
    finally:
        await client.close()
    settings = {"scenarios": list(cfg.scenarios), "sizes": cfg.sizes.__dict__, "thresholds": cfg.thresholds.__dict__,
                "tenants": ctx.tenants_how, "num_keys": len(cfg.api_keys), "seed": cfg.seed,
                "capabilities": {k: v for k, v in client.caps.__dict__.items()}}
    return ProbeResult(client.base_v1, client.model or "?", started, round(time.monotonic() - t0, 2), verdicts,
                       ctx.records, ctx.notes, durations, settings)


def run_probe_sync(cfg: ProbeConfig, **kw: Any) -> ProbeResult:
    return asyncio.run(run_probe(cfg, **kw))
