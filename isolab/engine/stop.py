"""Owns the stop rules: whether a request is done after the token it just sampled.

Pure and incremental: `check_stop` reads the request's parameters, its counts and only the text
that the new token completed (plus the few characters before it that a stop string could start
in), so one call costs O(len(new text) + longest stop string), not a re-decode of the output.
Does not finish requests (the scheduler does) nor decode tokens (the request's Detokenizer).

Order of the rules, first match wins (before min_tokens output tokens, only rules 0 and 4):
  0. the request's grammar is complete (structured outputs): "stop", no stop_reason (but a stop
     string the same token completed, which cuts the text all the same);
  1. the tokenizer's EOS (unless ignore_eos): "stop", no stop_reason;
  2. a token of stop_token_ids: "stop", stop_reason = the token;
  3. a stop string that ends in the new text: "stop", stop_reason = the string;
  4. max_tokens reached, or the context full: "length".
"""

from __future__ import annotations

from dataclasses import dataclass

from isolab.engine.request import RequestStatus
from isolab.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    status: RequestStatus  # FINISHED_STOPPED or FINISHED_LENGTH
    reason: str | int | None  # the stop string or stop token; None for EOS and length


def stop_string_in(text: str, new_len: int, stops: tuple[str, ...]) -> str | None:
    """The first stop string (in the order given) that ends within the last new_len characters of text.

    Earlier calls have seen every match that ends before them, so only those are new.
        text:  ... a b c | d e        new_len = 2, a stop "cd" ends at 'd': found
    """
    if new_len == 0:
        return None
    for s in stops:
        window = text[max(0, len(text) - new_len - len(s) + 1) :]
        if s in window:
            return s
    return None


def check_stop(
    params: SamplingParams,
    token: int,
    *,
    num_output_tokens: int,
    num_tokens: int,
    eos_token_id: int | None,
    max_model_len: int,
    end_of_turn: frozenset[int] = frozenset(),
    text: str = "",
    new_text_len: int = 0,
    grammar_done: bool = False,
) -> StopDecision | None:
    """After `token` was appended: the decision, or None to go on. text: the output decoded so far.
    Before min_tokens output tokens only the length rule applies."""
    if grammar_done:  # the structured output is complete: nothing but EOS may follow
        # (a stop string the same token completed cuts the text all the same: it is the reason then)
        s = stop_string_in(text, new_text_len, tuple(params.stop)) \
            if params.stop and num_output_tokens >= params.min_tokens else None
        return StopDecision(RequestStatus.FINISHED_STOPPED, s)
    if num_output_tokens < params.min_tokens:
        full = num_output_tokens >= params.max_tokens or num_tokens >= max_model_len
        return StopDecision(RequestStatus.FINISHED_LENGTH, None) if full else None
    if not params.ignore_eos and (token == eos_token_id or token in end_of_turn):
        return StopDecision(RequestStatus.FINISHED_STOPPED, None)
    if token in params.stop_token_ids:
        return StopDecision(RequestStatus.FINISHED_STOPPED, token)
    if params.stop:
        s = stop_string_in(text, new_text_len, tuple(params.stop))
        if s is not None:
            return StopDecision(RequestStatus.FINISHED_STOPPED, s)
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return StopDecision(RequestStatus.FINISHED_LENGTH, None)
    return None
