"""Owns SamplingParams: what a request asks of the sampler, validated once and frozen."""

from __future__ import annotations

from dataclasses import dataclass

from isolab.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set whose mass reaches top_p
    top_k: int = 0  # 0 = off
    seed: int | None = None  # one generator per request, seeded with this (random when None)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; N: and the top N

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{field} {why}", field=field)

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, not {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not (0.0 <= float(self.temperature) <= 100.0):
            raise bad("temperature", f"must be a number in [0, 100], not {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not (0.0 < float(self.top_p) <= 1.0):
            raise bad("top_p", f"must be in (0, 1], not {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), not {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not (0 <= self.seed < 2**63)):
            raise bad("seed", f"must be an integer in [0, 2**63), not {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], not {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
