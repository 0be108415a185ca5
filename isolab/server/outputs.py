"""Owns the two OpenAI logprobs formats: one choice's token logprobs, as deltas and in total.

Text deltas come from the one detokenizer, isolab.engine.detokenize.Detokenizer; this module only
turns the engine's TokenLogprobs into JSON. A logprob of -inf is sent as -9999.0 (JSON has no
infinity). Does not know HTTP or the engine loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from isolab.engine.request import TokenLogprob
from isolab.models.tokenizer import Tokenizer
from isolab.server.protocol import ChatLogprobsBody, ChatTokenLogprob, CompletionLogprobsBody


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0


class CompletionLogprobs:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.offset = 0
        self.total: CompletionLogprobsBody = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def push(self, lps: Sequence[TokenLogprob | int]) -> CompletionLogprobsBody:
        """These tokens' entries (a delta), also added to self.total. A bare token id is a token
        with no logprob (an echoed prompt's first token): null, as OpenAI writes it."""
        out: CompletionLogprobsBody = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            if isinstance(lp, int):
                text = self.tok.token_strings([lp])[0]
                out["tokens"].append(text)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                out["text_offset"].append(self.offset)
                self.offset += len(text)
                continue
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
        self.total["tokens"].extend(out["tokens"])
        self.total["token_logprobs"].extend(out["token_logprobs"])
        self.total["top_logprobs"].extend(out["top_logprobs"])
        self.total["text_offset"].extend(out["text_offset"])
        return out


class ChatLogprobs:
    """The chat format: one entry per token, each with its top alternatives."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.total: ChatLogprobsBody = {"content": []}

    def push(self, lps: Sequence[TokenLogprob]) -> ChatLogprobsBody:
        """These tokens' entries (a delta), also added to self.total."""
        content = [self._entry(lp) for lp in lps]
        self.total["content"].extend(content)
        return {"content": content}

    def _entry(self, lp: TokenLogprob) -> ChatTokenLogprob:
        text = self.tok.token_strings([lp.token_id])[0]
        top_ids = [t for t, _ in lp.top]
        top_texts = self.tok.token_strings(top_ids) if top_ids else []
        return {
            "token": text,
            "logprob": _finite(lp.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": s, "logprob": _finite(v), "bytes": list(s.encode("utf-8"))}
                for s, (_, v) in zip(top_texts, lp.top, strict=True)
            ],
        }
