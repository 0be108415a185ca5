"""Owns incremental detokenization for streaming: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from collections.abc import Sequence

from isolab.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """push(new ids) -> the new text since the last push. Holds back a trailing U+FFFD (an
    incomplete multi-byte character) until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text if text.startswith(self.emitted) else self.emitted
        return delta

    def flush_final(self, final_text: str) -> str:
        """What is left to print so that everything printed equals final_text."""
        rest = final_text[len(self.emitted) :] if final_text.startswith(self.emitted) else ""
        self.emitted = final_text
        return rest
