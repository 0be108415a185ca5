"""Owns the doctor's workload: the built-in mix, JSONL loading, and same-shape content variants.

Does not run anything (experiments.py) nor judge (verdict.py).

The built-in mix is built to exercise every kind of shared state a request can meet:

    family prefixes   four long preambles, each followed by different questions (prefix sharing)
    repeats           prompts sent twice, the second send later (the send that hits the cache)
    equal lengths     different prompts of one length (a key that forgets the tokens collides)
    extensions        a prompt, then the same prompt plus more while the first one decodes
    two scopes        tenants "a" and "b" send the same prompt (a key that forgets the scope)
    seeded sampling   temperature 1 with a seed: alone and together must agree (shared RNG)

A variant keeps every length, repeat and shared prefix and changes every word (text) or token
(ids), through one bijection: question (b), "does it depend on the input?".
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from isolab.errors import InvalidRequestError

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class Item:
    item_id: str
    prompt: Prompt  # text, or token ids once an engine target has tokenized it
    max_tokens: int = 12
    temperature: float = 0.0
    seed: int | None = None  # sampled items need one: otherwise no run can be compared to another
    scope: str | None = None  # cache scope (engine) or the value of the scope field (server)
    text: str | None = None  # the prompt's text, kept when `prompt` becomes token ids

    @property
    def comparable(self) -> bool:
        """Whether two runs of this item must agree: greedy, or sampled with a seed."""
        return self.temperature == 0.0 or self.seed is not None


_WORDS = (
    "amber basin cedar delta ember fjord grove harbor island jetty kettle lantern meadow nickel orchid "
    "pepper quarry river saddle timber umber valley willow yarrow zephyr anchor bramble copper dune "
    "falcon granite hollow iris juniper kestrel linen marble nectar onyx pebble quartz"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def builtin_workload(seed: int = 0) -> list[Item]:
    """About 30 requests whose order (arrival order) puts each repeat several places after its first send."""
    rng = random.Random(seed)
    # Lengths in words: at least 16 tokens (one full block) for a real tokenizer, ~6 per word for a byte one.
    fam = [_sentence(rng, 20) for _ in range(3)]
    same_len = [_sentence(rng, 14) for _ in range(4)]
    base = _sentence(rng, 16)
    shared = _sentence(rng, 16)
    rep = [_sentence(rng, 14) for _ in range(3)]
    sampled = [_sentence(rng, 5) for _ in range(4)]
    items: list[Item] = []

    def add(prompt: str, **kw: object) -> None:
        items.append(Item(f"r{len(items):02d}", prompt, **kw))  # type: ignore[arg-type]

    add(base, max_tokens=20)  # decodes long while its extension arrives
    add(base + " " + _sentence(rng, 3), max_tokens=8)
    for s in same_len[:2]:
        add(s)
    add(fam[0] + " " + _sentence(rng, 3))
    add(rep[0])
    add(shared, scope="a")
    add(shared, scope="b")  # same tokens, other tenant: must not hit scope a's blocks
    add(sampled[0], temperature=1.0, seed=11)
    add(fam[1] + " " + _sentence(rng, 3))
    add(sampled[1], temperature=1.0, seed=12)
    add(rep[1])
    add(fam[0] + " " + _sentence(rng, 4))
    add(same_len[2])
    add(rep[0])  # repeat
    add(fam[2] + " " + _sentence(rng, 2))
    add(sampled[2], temperature=1.0, seed=13)
    add(fam[1] + " " + _sentence(rng, 4))
    add(rep[2])
    add(same_len[3])
    add(rep[1])  # repeat
    add(sampled[3], temperature=1.0, seed=14)
    add(fam[2] + " " + _sentence(rng, 3))
    add(shared, scope="a")  # same tenant: may hit
    add(rep[2])  # repeat
    add(base + " " + _sentence(rng, 2), max_tokens=6)
    add(fam[0] + " " + _sentence(rng, 2))
    add(rep[0])  # third send
    return items


def load_jsonl(path: str | Path) -> list[Item]:
    """One JSON object a line: {"prompt": str, "max_tokens"?, "temperature"?, "seed"?, "scope"?, "id"?}."""
    items: list[Item] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the workload {path}: {exc.strerror}", field="workload") from None
    except UnicodeDecodeError:
        raise InvalidRequestError(f"the workload {path} is not UTF-8 text: write one JSON object a line",
                                  field="workload") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt = rec["prompt"]
            assert isinstance(prompt, str) and prompt
            items.append(Item(
                str(rec.get("id", f"r{len(items):02d}")), prompt, int(rec.get("max_tokens", 12)),
                float(rec.get("temperature", 0.0)), rec.get("seed"), rec.get("scope"),
            ))
        except (ValueError, KeyError, TypeError, AssertionError):
            raise InvalidRequestError(
                f"{path} line {n} is not a JSON object with a non-empty string \"prompt\"", field="workload"
            ) from None
        if items[-1].max_tokens < 1:  # (a request of no tokens has nothing to compare)
            raise InvalidRequestError(f"{path} line {n}: max_tokens must be at least 1", field="workload")
    if not items:
        raise InvalidRequestError(f"the workload {path} holds no prompts", field="workload")
    return items


def word_variant(items: Sequence[Item], seed: int) -> list[Item]:
    """Each distinct word becomes another of the same length, everywhere (one bijection), the
    whitespace kept: the workload's words of one length are permuted among themselves (each to
    another: real words, so a server's tokenizer cuts them about as it cut the originals); a length
    only one word has gets made-up letters."""
    rng = random.Random(seed)
    prompts = []
    for it in items:
        assert isinstance(it.prompt, str)
        prompts.append(re.split(r"(\s+)", it.prompt))  # words at even positions, whitespace at odd
    words = list(dict.fromkeys(w for parts in prompts for w in parts[::2] if w))
    by_len: dict[int, list[str]] = {}
    for w in words:
        by_len.setdefault(len(w), []).append(w)
    mapping: dict[str, str] = {"": ""}
    for n, group in by_len.items():
        if len(group) > 1:  # a shuffled cycle: a bijection with no word left in place
            rng.shuffle(group)
            mapping.update(zip(group, group[1:] + group[:1], strict=True))
        else:  # 26^n - 1 >= 25 other strings of this length, none of them a word of the workload
            while (new := "".join(rng.choice(string.ascii_lowercase) for _ in range(n))) == group[0]:
                pass
            mapping[group[0]] = new
    return [replace(it, prompt="".join(p if i % 2 else mapping[p] for i, p in enumerate(parts)))
            for it, parts in zip(items, prompts, strict=True)]


def token_variant(items: Sequence[Item], seed: int, lo: int, hi: int) -> list[Item]:
    """Each distinct token id becomes another id in [lo, hi), everywhere (one bijection)."""
    rng = random.Random(seed)
    distinct = sorted({t for it in items for t in it.prompt})  # type: ignore[union-attr]
    pool = list(range(lo, hi))
    rng.shuffle(pool)
    pool = [t for t in pool if t not in set(distinct)] + [t for t in pool if t in set(distinct)]
    assert len(pool) >= len(distinct), "the vocabulary is smaller than the workload's distinct tokens"
    mapping = dict(zip(distinct, pool, strict=False))
    return [replace(it, prompt=tuple(mapping[t] for t in it.prompt)) for it in items]  # type: ignore[union-attr]
