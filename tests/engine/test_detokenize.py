"""The one detokenizer's stop-string hold-back (engine/detokenize.py): streamed deltas add up to the
final text, never show text past the earliest stop string, and hold back only the end of the text
that begins a stop string (as docs/server.md says), not a fixed number of characters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from isolab.engine.detokenize import Detokenizer


class CharTokenizer:
    """One character a token: decode is the characters joined."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ARG002
        return "".join(chr(i) for i in ids)


def begun(text: str, stops: list[str]) -> int:
    """The longest end of text that is a proper beginning of a stop string (the reference)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


ALPHABET = "abQ "


def counted(seen: str, stops: list[str], min_tokens: int) -> list[int]:
    """Where the stop strings that count start: those ending past the first min_tokens - 1 characters
    (one character a token here), as the engine's rule checks them."""
    return [i for s in stops for i in range(len(seen) - len(s) + 1)
            if seen.startswith(s, i) and i + len(s) > max(0, min_tokens - 1)]


@settings(max_examples=300, deadline=None)
@given(st.text(ALPHABET, max_size=40), st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.integers(1, 3), min_size=1, max_size=40), st.integers(0, 8))
def test_held_back_is_only_what_begins_a_stop_string(text, stops, steps, min_tokens):
    """The engine ends a request at the push whose text completes a stop string that counts
    (scheduler._check_stop; none before min_tokens); the stream stops there too."""
    d = Detokenizer(CharTokenizer(), stops, min_tokens)
    sent, pos = "", 0
    for n in steps * 40:
        if pos >= len(text):
            break
        n = 1 if pos < min_tokens else n  # the engine checks each token from min_tokens on
        sent += d.push([ord(c) for c in text[pos : pos + n]])
        pos += n
        seen = text[:pos]
        if counted(seen, stops, min_tokens):
            break
        assert sent == seen[: len(seen) - begun(seen, stops)]  # all but a stop's beginning is out
    seen = text[:pos]
    cuts = counted(seen, stops, min_tokens)
    final = seen[: min(cuts)] if cuts else seen
    assert final.startswith(sent)  # nothing past the earliest stop string went out
    assert sent + d.finish() == final


def test_stop_strings_before_min_tokens_do_not_cut_the_text():
    """min_tokens=6 with stop ".": the engine ignores the "." of the first 5 tokens and stops at the
    next one, so the reply is "A. B. C", not "A" (one character a token)."""
    d = Detokenizer(CharTokenizer(), ["."], min_tokens=6)
    out = "".join(d.push([ord(c)]) for c in "A. B. C. D")
    assert out + d.finish() == "A. B. C"


def test_a_long_stop_string_does_not_hold_back_text_that_cannot_begin_it():
    d = Detokenizer(CharTokenizer(), ["Q" * 200])
    assert d.push([ord(c) for c in "Hello there"]) == "Hello there"
    assert d.push([ord(c) for c in " QQ"]) == " "
    assert d.push([ord("x")]) == "QQx"
    assert d.finish() == ""
