"""Owns turning one engine request's token stream into OpenAI text deltas and logprobs.

Text: decoded incrementally over a sliding window (O(1) per token), never splitting a UTF-8
character; with stop strings, the last (longest stop - 1) characters are held back until the
request finishes, and the final text ends before the earliest stop string, as OpenAI does.
At the finish the whole output is decoded once, so the streamed deltas always add up to exactly
the non-streamed text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from isolab.engine.request import TokenLogprob
from isolab.models.tokenizer import Tokenizer


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0


class ChoiceText:
    """push(new ids) -> text delta; finish() -> the rest. Concatenated deltas == final text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tok = tokenizer
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded again for context
        self._read_offset = 0  # ids before this are already in self._decoded
        self._decoded = ""
        self.sent = ""  # what has gone out as deltas

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        window = self.tok.decode(self.ids[self._prefix_offset :])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self._decoded += window[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._emit(self._visible(self._decoded, final=False))

    def finish(self) -> str:
        """The remaining delta once the request has finished."""
        self._decoded = self.tok.decode(self.ids)
        return self._emit(self._visible(self._decoded, final=True))

    def _visible(self, text: str, *, final: bool) -> str:
        cut = len(text)
        for s in self.stop:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
        if not final and cut == len(text) and self.holdback:
            cut = max(0, len(text) - self.holdback)
        return text[:cut]

    def _emit(self, visible: str) -> str:
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        delta = visible[len(self.sent) :]
        self.sent = visible
        return delta


class CompletionLogprobs:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.offset = 0

    def format(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = self.tok.token_strings([lp.token_id])[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp.logprob))
            top_ids = [t for t, _ in lp.top]
            top_texts = self.tok.token_strings(top_ids) if top_ids else []
            top: dict[str, float] = {}
            for s, (_, v) in zip(top_texts, lp.top, strict=True):
                top.setdefault(s, _finite(v))  # two tokens may print alike (byte pieces): keep the best
            out["top_logprobs"].append(top if lp.top else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(tokenizer: Tokenizer, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """The chat format: one entry per token, each with its top alternatives."""
    content = []
    for lp in lps:
        text = tokenizer.token_strings([lp.token_id])[0]
        top_ids = [t for t, _ in lp.top]
        top_texts = tokenizer.token_strings(top_ids) if top_ids else []
        content.append({
            "token": text,
            "logprob": _finite(lp.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": s, "logprob": _finite(v), "bytes": list(s.encode("utf-8"))}
                for s, (_, v) in zip(top_texts, lp.top, strict=True)
            ],
        })
    return content
