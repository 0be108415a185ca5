"""Owns detokenization: one request's token stream as text deltas, O(1) per token.

Does not know HTTP or the engine loop. Used by the engine's stop checker (stop strings), the
server's replies and `isolab generate`: the one detokenizer of the project.

Text is decoded over a sliding window (the last complete token before the new ones gives the
context a tokenizer needs for leading spaces), never splitting a UTF-8 character: a window that
ends in U+FFFD waits for the next token. With stop strings, the last (longest stop - 1)
characters are examined, and the longest end of the text that begins a stop string is held back
(other text goes out at once); the final text ends before the earliest stop string, as OpenAI
does. `finish()` decodes the whole output once, so the deltas
always add up to exactly the final text.

    ids:   i0 i1 i2 i3 i4 i5
                 ^prefix  ^read       decoded = text of ids[:read]
    push(i6): window = decode(ids[prefix:]), before = decode(ids[prefix:read])
              new text = window[len(before):]
"""

from __future__ import annotations

from collections.abc import Sequence

from isolab.models.tokenizer import Tokenizer


class Detokenizer:
    """push(new ids) -> text delta; finish() -> the rest. Concatenated deltas == final text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tok = tokenizer
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
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
        return self._emit(self._visible(self.text, final=False))

    def decode(self, new_ids: Sequence[int]) -> str:
        """Extend self.text by the new ids; returns the text they completed (maybe "")."""
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        window = self.tok.decode(self.ids[self._prefix_offset :])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            new = window[len(before) :]
            self.text += new
            self.pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return new
        self.pending = window[len(before) :]
        return ""

    def finish(self) -> str:
        """The remaining delta once the request has finished."""
        self.text = self.tok.decode(self.ids)
        return self._emit(self._visible(self.text, final=True))

    def _visible(self, text: str, *, final: bool) -> str:
        cut = len(text)
        for s in self.stop:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
        if not final and cut == len(text) and self.holdback:
            cut = len(text) - self._stop_begun(text)
        return text[:cut]

    def _stop_begun(self, text: str) -> int:
        """The length of the longest end of the text that begins a stop string: what must wait (a
        stop string may still complete it). Other text goes out at once."""
        tail = text[-self.holdback :]
        longest = 0
        for s in self.stop:
            first = s[0]
            j = tail.find(first, max(0, len(tail) - len(s) + 1))
            while j != -1 and len(tail) - j > longest:
                if s.startswith(tail[j:]):  # the first start found is the longest one
                    longest = len(tail) - j
                    break
                j = tail.find(first, j + 1)
        return longest

    def _emit(self, visible: str) -> str:
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        delta = visible[len(self.sent) :]
        self.sent = visible
        return delta
