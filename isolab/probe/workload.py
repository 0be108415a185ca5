"""Owns the probe's prompts: novel prefixes (a random word first), canaries, and plain filler text.

Every prompt starts with a fresh random nonce, so nothing the probe sends can share more than a
character or two with anything sent before it (that makes the cached_tokens bound sound). Canaries
are random letter strings ("zq-canary-kvtbrm") that no model writes by chance.
"""

from __future__ import annotations

import random

SENTENCES = (
    "The river runs past the old mill and under the stone bridge.",
    "Our team meets on Tuesdays to plan the next release of the tool.",
    "A lighthouse keeper writes the weather in a leather notebook each night.",
    "The recipe needs two cups of flour, one egg and a pinch of salt.",
    "Trains to the coast leave every hour from the northern platform.",
    "She planted tomatoes, beans and basil along the southern fence.",
    "The museum opens at nine and closes early on public holidays.",
    "Most of the invoices were paid before the end of the quarter.",
    "Bees return to the hive when the afternoon light begins to fade.",
    "He tuned the old piano by ear before the concert started.",
    "The library keeps rare maps in a cool room without windows.",
    "Snow closed the mountain pass for three days in February.",
    "A small bakery on the corner sells bread until it runs out.",
    "The committee approved the budget after a long discussion.",
    "Fishing boats came back late because of the strong wind.",
    "Children painted the classroom walls with bright green leaves.",
)
_LETTERS = "bcdfghjklmnpqrstvwxz"


class Workload:
    """Random prompts for one probe run; `seed` makes a run's prompts reproducible."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.canaries: list[str] = []
        self._used: set[str] = set()

    def word(self, n: int = 6) -> str:
        while True:
            w = "".join(self.rng.choice(_LETTERS) for _ in range(n))
            if w not in self._used:
                self._used.add(w)
                return w

    def canary(self) -> str:
        c = f"zq-canary-{self.word(6)}"
        self.canaries.append(c)
        return c

    def filler(self, n: int) -> str:
        return " ".join(self.rng.choice(SENTENCES) for _ in range(n))

    def secret(self, n_sentences: int = 3, canary: str | None = None) -> tuple[str, str]:
        """(prompt, canary): a novel prompt that holds a canary and asks for it back."""
        c = canary or self.canary()
        prompt = (f"{self.word().capitalize()} notes. The access code is {c}. {self.filler(n_sentences)} "
                  f"Remember: the access code is {c}. Repeat the access code:")
        return prompt, c

    def plain(self, n_sentences: int = 2) -> str:
        return f"{self.word().capitalize()} story. {self.filler(n_sentences)}"

    def same_length_pair(self, n_sentences: int = 3) -> tuple[tuple[str, str], tuple[str, str]]:
        """Two different secret prompts of equal length in characters: same filler, other nonce and canary."""
        text = self.filler(n_sentences)
        out = []
        for _ in range(2):
            c = self.canary()
            out.append((f"{self.word().capitalize()} notes. The access code is {c}. {text} Repeat the access code:", c))
        assert len(out[0][0]) == len(out[1][0])
        return out[0], out[1]

    def one_char_off(self, prompt: str, position: int) -> str:
        """The prompt with the letter at `position` replaced (the rest identical)."""
        old = prompt[position]
        new = next(ch for ch in "xqz" if ch != old.lower())
        return prompt[:position] + new + prompt[position + 1 :]
