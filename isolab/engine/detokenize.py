"""Owns detokenization: one request's token stream as text deltas, O(new text) per token.

Does not know HTTP or the engine loop. Used by the engine's stop checker (stop strings), the
server's replies and `isolab generate`: the one detokenizer of the project.

Text is decoded over a sliding window (the last complete token before the new ones gives the
context a tokenizer needs for leading spaces), never splitting a UTF-8 character: a window that
ends in U+FFFD waits for the next token. With stop strings, the longest end of the text that
begins one is held back (other text goes out at once), and the final text ends before the earliest
stop string, as OpenAI does; a stop string that ends in the text of the first min_tokens - 1
tokens does not count, as the engine's stop rule does not check them (engine/stop.py). Each stop
string has its own matcher (Knuth-Morris-Pratt: the longest end of the text that begins it, moved
by the new characters only), so a token costs O(its characters x stop strings), whatever the
length of the text or of the stop strings (64 of 1,024 characters are allowed). `finish()`
decodes the whole output once, so the deltas always add up to exactly the final text.

    ids:   i0 i1 i2 i3 i4 i5
                 ^prefix  ^read       decoded = text of ids[:read]
    push(i6): window = decode(ids[prefix:]), before = decode(ids[prefix:read])
              new text = window[len(before):]
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence

from isolab.models.tokenizer import Tokenizer


@functools.lru_cache(maxsize=4096)
def _failure(s: str) -> tuple[int, ...]:
    """KMP's table: [i] is the longest proper border of s[: i + 1]. Cached: a request's n choices (and
    the next request with the same stop strings) share it."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class _StopMatcher:
    """One stop string's KMP state: the length of the longest end of the text fed so far that
    begins it (its whole length at a match)."""

    __slots__ = ("s", "fail", "state")

    def __init__(self, s: str) -> None:
        self.s = s
        self.fail = _failure(s)
        self.state = 0

    def held(self) -> int:
        """The longest end of the text that begins the stop string and may still grow into it (at a
        match that did not count, before min_tokens: the match's longest border)."""
        return self.state if self.state < len(self.s) else self.fail[-1]

    def feed(self, text: str, after: int = 0) -> int | None:
        """Move over text; the index in it just past the first match that ends past `after`."""
        s, fail, k, n = self.s, self.fail, self.state, len(self.s)
        found = None
        for i, c in enumerate(text):
            if k == n:
                k = fail[k - 1]
            while k and s[k] != c:
                k = fail[k - 1]
            if s[k] == c:
                k += 1
            if k == n and found is None and i + 1 > after:
                found = i + 1
        self.state = k
        return found


class Detokenizer:
    """push(new ids) -> text delta; finish() -> the rest. Concatenated deltas == final text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.tok = tokenizer
        self.min_tokens = min_tokens
        self._matchers = [_StopMatcher(s) for s in stop]
        self._fed = 0  # characters of self.text the matchers have seen
        self._checked_from = 0  # a match ending at or before this character is before min_tokens: no stop
        self.first_stop: int | None = None  # where the earliest counted stop string starts in self.text
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded again for context
        self._read_offset = 0  # ids before this are already in self.text
        self.text = ""  # the decoded text so far (complete characters only), stop strings not cut
        # Text of the ids after the last complete character, as a full decode shows it now (ends
        # in U+FFFD): a character still being completed, or bytes that never form one.
        self.pending = ""
        self.sent = ""  # what has gone out as deltas

    def push(self, new_ids: Sequence[int]) -> str:
        self.decode(new_ids)
        return self._emit(self._visible(final=False))

    def decode(self, new_ids: Sequence[int]) -> str:
        """Extend self.text by the new ids; returns the text they completed (maybe "")."""
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        window = self.tok.decode(self.ids[self._prefix_offset :])
        new = ""
        if len(window) > len(before) and not window.endswith("\ufffd"):
            new = window[len(before) :]
            self.text += new
            self.pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        else:
            self.pending = window[len(before) :]
        if len(self.ids) < self.min_tokens:  # the text of the first min_tokens - 1 tokens: not checked
            self._checked_from = len(self.text)
        return new

    def checkable(self) -> str:
        """The pending text a stop string may match now: all of it, less the U+FFFD that stands for a
        character whose next bytes have not come yet (it is no text anyone is sent: those bytes
        replace it). Bytes that can never form a character stay U+FFFD in the final text: kept."""
        if not self.pending.endswith("\ufffd"):
            return self.pending
        tail = b"".join(self.tok.token_bytes(self.ids[self._read_offset :]))
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.decode(tail, final=False)
        return self.pending[:-1] if dec.getstate()[0] else self.pending

    def finish(self) -> str:
        """The remaining delta once the request has finished."""
        self.text = self.tok.decode(self.ids)
        return self._emit(self._visible(final=True))

    def _feed(self) -> None:
        """The matchers over the text not yet fed; the earliest counted stop string."""
        new, base = self.text[self._fed :], self._fed
        self._fed = len(self.text)
        for m in self._matchers if new else ():
            end = m.feed(new, after=self._checked_from - base)
            if end is not None:
                start = base + end - len(m.s)
                self.first_stop = start if self.first_stop is None else min(self.first_stop, start)

    def _visible(self, *, final: bool) -> str:
        self._feed()
        if self.first_stop is not None:
            return self.text[: self.first_stop]
        if final:
            return self.text
        held = max((m.held() for m in self._matchers), default=0)  # the end that begins a stop string
        return self.text[: len(self.text) - held]

    def _emit(self, visible: str) -> str:
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        delta = visible[len(self.sent) :]
        self.sent = visible
        return delta
