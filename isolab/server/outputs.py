"""Owns the two OpenAI logprobs formats: one choice's token logprobs, as deltas and in total.

Text deltas come from the one detokenizer, isolab.engine.detokenize.Detokenizer; this module only
turns the engine's TokenLogprobs into JSON. A logprob of -inf is sent as -9999.0 (JSON has no
infinity). Does not know HTTP or the engine loop.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from isolab.engine.request import TokenLogprob
from isolab.models.tokenizer import Tokenizer
from isolab.server.protocol import ChatLogprobsBody, ChatTokenLogprob, CompletionLogprobsBody


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0


def _text(raw: bytes) -> str:
    """A token's text: its bytes as UTF-8, where a piece of a character is written as \\xNN escapes
    (as OpenAI writes it), so pieces do not all print as U+FFFD (two tokens of the same bytes, e.g.
    Gemma's <0x41> and A, still print alike); a client reads the exact bytes from `bytes`."""
    return raw.decode("utf-8", errors="backslashreplace")


class CompletionLogprobs:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.offset = 0
        self.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a character's first bytes
        self.total: CompletionLogprobsBody = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def push(self, lps: Sequence[TokenLogprob | int]) -> CompletionLogprobsBody:
        """These tokens' entries (a delta), also added to self.total. A bare token id is a token
        with no logprob (an echoed prompt's first token): null, as OpenAI writes it."""
        out: CompletionLogprobsBody = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            token_id = lp if isinstance(lp, int) else lp.token_id
            raw = self.tok.token_bytes([token_id])[0]
            out["tokens"].append(_text(raw))
            # the offset in characters of the text: the whole characters before this token
            out["text_offset"].append(self.offset)
            self.offset += len(self.chars.decode(raw))
            if isinstance(lp, int):
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(lp.logprob))
            top_ids = [t for t, _ in lp.top]
            top: dict[str, float] = {}
            for b, (_, v) in zip(self.tok.token_bytes(top_ids), lp.top, strict=True):
                top.setdefault(_text(b), _finite(v))  # (two tokens of the same bytes: keep the best)
            # the sampled token always, as OpenAI's legacy format has it ("up to logprobs + 1
            # elements") and vLLM's: so logprobs 0 gives {token: logprob}, not null
            top.setdefault(_text(raw), _finite(lp.logprob))
            out["top_logprobs"].append(top)
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
        raw = self.tok.token_bytes([lp.token_id])[0]
        top_ids = [t for t, _ in lp.top]
        return {
            "token": _text(raw),
            "logprob": _finite(lp.logprob),
            "bytes": list(raw),
            "top_logprobs": [
                {"token": _text(b), "logprob": _finite(v), "bytes": list(b)}
                for b, (_, v) in zip(self.tok.token_bytes(top_ids), lp.top, strict=True)
            ],
        }
