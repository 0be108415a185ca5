"""A logprobs entry's token text back to its bytes, as the tests read it: the server writes a piece of
a UTF-8 character as \\xNN escapes (isolab/server/outputs.py), other text as itself."""

from __future__ import annotations


def token_bytes(token: str) -> bytes:
    out, i = b"", 0
    while i < len(token):
        if token.startswith("\\x", i):
            out, i = out + bytes([int(token[i + 2:i + 4], 16)]), i + 4
        else:
            out, i = out + token[i].encode(), i + 1
    return out
