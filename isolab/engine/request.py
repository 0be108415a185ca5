"""Owns Request: everything the engine knows about one request, in one object.

There is no prefill or decode phase: `num_computed_tokens` catches up with `num_tokens`
(prompt + output so far); a step computes some of the missing tokens, and a token is sampled
whenever the two meet. Only the scheduler writes the fields that change during a request's life.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from isolab.engine.detokenize import Detokenizer
from isolab.engine.hashing import BlockKey
from isolab.errors import IsolabError
from isolab.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # eos, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the top-N (token id, logprob), best first


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    scope: str | None  # cache scope: blocks are shared only between requests of one scope
    # prompt + output, appended as tokens are sampled. Invariant: len == num_tokens.
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs only: entry i is prompt token i + 1's, filled as prompt chunks compute
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Invariant: 0 <= num_computed_tokens <= num_tokens; K/V of tokens [0, num_computed) are in the cache.
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling (tokens)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None  # this request's own RNG (C17)
    detokenizer: Detokenizer | None = None  # set iff params.stop: the stop checker's text, O(1) a token
    # set iff params.structured: this request's own grammar state (llguidance.LLMatcher), never shared;
    # the sampler masks with it, Scheduler.update advances it by each sampled token
    matcher: Any = None
    # why the request failed where it is its own doing (a grammar no token continues): its output's error
    error: IsolabError | None = None
    # Keys of the request's full blocks, chained from the first (see hashing.py).
    block_keys: list[BlockKey] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
