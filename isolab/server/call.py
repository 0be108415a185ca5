"""Owns one HTTP request in flight: its choices, the engine outputs folded into them, its usage.

    RequestOutput -> Call.consume -> the choice's text (Detokenizer) and counts
                                  -> its Format's chunk piece (text delta and/or logprobs)

A choice is one engine request. Call also counts what it sees into the server's metrics (first
token, tokens, finish reasons, latency). Does not know HTTP, admission or tenants.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from isolab.engine.detokenize import Detokenizer
from isolab.engine.llm_engine import RequestOutput
from isolab.engine.request import TokenLogprob
from isolab.errors import EngineUnavailable, InvalidRequestError, ModelOutputError, RequestAborted
from isolab.server.formats import ChoiceFormat, Format
from isolab.server.metrics import ServerMetrics
from isolab.server.protocol import Chunk, ChunkChoice, FinalChoice, Reply, Usage


@dataclass
class Choice:
    # Mutable: it accumulates its engine request's outputs.
    index: int
    request_id: str
    text: Detokenizer
    out: ChoiceFormat
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended it (vLLM's field)
    error: str | None = None
    error_status: int = 500  # 400 where the request itself made it fail (InvalidRequestError), 503 at shutdown
    error_param: str | None = None  # the field that did, at 400
    # logprobs entries not yet sent, each with the length of the text its token completes: an entry
    # goes out with the chunk that carries its token's text (text held back for a stop string, or a
    # character still being completed, holds its entries back too)
    held: list[tuple[int, TokenLogprob]] = field(default_factory=list)
    held_from: int = 0  # where the first held entry's token text starts (the last one sent's end)

    def final(self) -> FinalChoice:
        """The non-streamed choice, with vLLM's stop_reason."""
        return _with_stop_reason(self.out.final(self.text.sent, self.finish_reason), self)

    def finish_chunks(self) -> list[ChunkChoice]:
        """A stream's last pieces; the one that carries the finish_reason carries stop_reason too."""
        pieces = list(self.out.finish(self.finish_reason or "stop"))
        if pieces:
            _with_stop_reason(pieces[-1], self)
        return pieces


def _with_stop_reason(choice: Any, c: Choice) -> Any:
    choice["stop_reason"] = c.stop_reason
    return choice


@dataclass
class Call:
    # Mutable: choices fill in as outputs arrive; `done` once its clean-up has run.
    fmt: Format[Any]
    response_id: str
    created: int
    model: str
    prompt_lengths: list[int]
    choices: list[Choice]
    stream: bool
    include_usage: bool
    arrival: float  # time.monotonic() when its engine requests were built
    metrics: ServerMetrics
    first_token_at: float | None = None
    done: bool = False
    errors_sent: set[str] = field(default_factory=set)  # a stream sends each error once, not once a choice
    by_request: dict[str, Choice] = field(init=False)

    def __post_init__(self) -> None:
        self.by_request = {c.request_id: c for c in self.choices}

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def unfinished_ids(self) -> list[str]:
        return [c.request_id for c in self.choices if c.finish_reason is None]

    @property
    def cached_tokens(self) -> int:
        # the first choice of each prompt (later choices share what it wrote)
        n = len(self.choices) // len(self.prompt_lengths)
        return sum(self.choices[i * n].num_cached_tokens for i in range(len(self.prompt_lengths)))

    def usage(self) -> Usage:
        prompt = sum(self.prompt_lengths)
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def consume(self, o: RequestOutput) -> tuple[Choice, ChunkChoice | None]:
        """Fold one output into its choice; returns (the choice, its chunk piece if any)."""
        c = self.by_request[o.request_id]
        c.num_cached_tokens = o.num_cached_tokens  # (on every output: a max_tokens 0 request has no token)
        delta = ""
        lps: Sequence[TokenLogprob] = ()
        if o.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
                self.metrics.ttft.observe(self.first_token_at - self.arrival)
            c.num_tokens += len(o.new_token_ids)
            self.metrics.generation_tokens.inc(len(o.new_token_ids))
            ids, new_lps = o.new_token_ids, o.new_logprobs
            if o.stopped_by_token:  # the stop token is cut as a stop string is (vLLM): no text, no entry
                ids, new_lps = ids[:-1], new_lps[: len(ids) - 1]
            delta = c.text.push(ids)
            # the text its token completes: with a character still open (a pending that may hold whole
            # characters before it, e.g. " " then the first bytes of an emoji), that character too
            pending = c.text.pending
            ends = len(c.text.text) + (len(pending.rstrip("\ufffd")) + 1 if pending else 0)
            # a special token the text leaves out (EOS, an <|im_end|> under ignore_eos) has no entry, as
            # OpenAI gives the token that ends the turn none: the entries spell the text
            c.held.extend((ends, lp) for lp in new_lps if not c.text.tok.is_skipped(lp.token_id))
        if o.finished:
            delta += c.text.finish()
            c.finish_reason = o.finish_reason or "stop"
            c.stop_reason = o.stop_reason
            if isinstance(o.error, InvalidRequestError):
                c.error, c.error_status, c.error_param = str(o.error), 400, o.error.field
            elif isinstance(o.error, RequestAborted):  # the server is shutting down (its drain ran out)
                c.error, c.error_status = str(o.error), 503
                c.finish_reason = "shutdown"  # (not a client's abort, in the log and the metrics)
            elif o.error is not None or o.finish_reason == "error":
                shown = isinstance(o.error, (EngineUnavailable, ModelOutputError)) or o.finish_reason != "error"
                c.error = str(o.error) if shown else "the engine failed this request"
            self.metrics.requests_finished.labels(c.finish_reason).inc()
        if c.held:
            sent = len(c.text.sent)
            ready = len(c.held) if o.finished else next((i for i, (ends, _) in enumerate(c.held) if ends > sent), len(c.held))
            if o.finished and c.text.first_stop is not None:  # a stop string was cut: tokens wholly inside it go too
                starts = [c.held_from] + [ends for ends, _ in c.held[:-1]]
                ready = next((i for i, start in enumerate(starts) if start >= sent), ready)
            lps = [lp for _, lp in c.held[:ready]]
            if ready:
                c.held_from = c.held[ready - 1][0]
            del c.held[: len(c.held) if o.finished else ready]
        return c, c.out.delta(delta, lps, o.prompt_logprobs)

    def observe_done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)

    def reply(self) -> Reply:
        return {"id": self.response_id, "object": self.fmt.object, "created": self.created, "model": self.model,
                "choices": [c.final() for c in self.choices], "usage": self.usage()}

    def chunk(self, choice: ChunkChoice) -> Chunk:
        out: Chunk = {"id": self.response_id, "object": self.fmt.chunk_object, "created": self.created,
                      "model": self.model, "choices": [choice]}
        if self.include_usage:  # OpenAI: with include_usage, every chunk but the last carries "usage": null
            out["usage"] = None
        return out

    def usage_chunk(self) -> Chunk:
        return {"id": self.response_id, "object": self.fmt.chunk_object, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}
