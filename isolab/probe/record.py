"""Owns what the probe records of one request: `Completion`, plain data that round-trips through JSON.

The verdict logic (isolab.probe.verdicts) reads only these records, never the network, so every
verdict can be re-derived from a saved report and unit-tested on recorded responses.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Completion:
    prompt: str
    text: str = ""
    # Per output position, when the server gave logprobs (None otherwise):
    tokens: list[str] | None = None  # the chosen token's text
    token_logprobs: list[float | None] | None = None  # its logprob
    top_logprobs: list[dict[str, float]] | None = None  # the top-k alternatives, token text -> logprob
    finish_reason: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    prompt_tokens: int | None = None
    ttft_s: float | None = None  # time to the first text chunk (streamed requests only)
    latency_s: float | None = None  # time to the whole reply
    sent_at: float | None = None  # seconds since the probe started
    tenant: str = "A"  # which identity sent it: a key's label or a salt's label
    seed: int | None = None
    temperature: float = 0.0
    status: int = 200
    error: str | None = None  # set when the request failed; the other fields are then empty
    tags: list[str] = field(default_factory=list)  # what the scenario used it for

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def has_logprobs(self) -> bool:
        return self.tokens is not None and self.token_logprobs is not None

    def units(self) -> list[str]:
        """What to compare position by position: tokens when known, characters otherwise."""
        return list(self.tokens) if self.tokens is not None else list(self.text)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Completion:
        known = {f.name for f in fields(cls)}
        return cls(**{k: copy.deepcopy(v) for k, v in data.items() if k in known})
