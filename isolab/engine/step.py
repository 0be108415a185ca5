"""Owns the step contract's data: what flows from the scheduler to the runner and back.

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
        -> Scheduler.update(SchedulerOutput, ModelRunnerOutput) -> finished requests

Plain frozen values; no behaviour beyond derived properties. The runner reads requests' tokens
but never writes a request; only the scheduler writes num_computed_tokens and the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolab.engine.request import Request, TokenLogprob


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # num_computed_tokens before this step: the first position computed
    num_new_tokens: int  # tokens [start, start + num_new_tokens) are computed this step

    @property
    def end(self) -> int:
        """num_computed_tokens after this step."""
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so a token is sampled."""
        return self.end == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # running requests first (oldest first), then admissions

    def without(self, request_ids: set[str]) -> SchedulerOutput:
        """The same step minus the chunks of these requests (the auditor aborted them)."""
        return SchedulerOutput(tuple(c for c in self.chunks if c.request.request_id not in request_ids))


# The token drawn for a row whose logits are not numbers (NaN: broken weights in the file): no token is
# kept, and the scheduler fails that request alone with a sentence (torch.multinomial raised for the
# whole batch; greedy took token 0 forever)
NOT_FINITE = -1


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int  # NOT_FINITE: this row's logits were NaN
    logprob: TokenLogprob | None  # None unless the request asked for logprobs


@dataclass(frozen=True)
class ModelRunnerOutput:
    # One per sampling chunk (ScheduledChunk.samples), in chunk order. Every chunk of the step was
    # computed: its K/V are in the pool, to be committed by Scheduler.update.
    sampled: tuple[SampledToken, ...]
    # (request id, first prompt position p, logprobs of prompt tokens p, p + 1, ...) for the chunks of
    # requests that asked for prompt logprobs; p >= 1 (the first prompt token has none)
    prompt_logprobs: tuple[tuple[str, int, tuple[TokenLogprob, ...]], ...] = ()
