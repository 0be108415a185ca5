"""Owns a corpus of varied JSON schemas for structured-output tests and benchmarks: nested objects,
arrays, enums, bounded numbers, required and optional properties, anyOf. Every size is bounded, so
even a random model's constrained output closes within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "age", "city", "score", "tags", "kind", "id", "items", "note", "level", "ok", "size"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    k = rng.randrange(7)
    if k == 0:
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if k == 1:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if k == 2:
        return {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25}  # bounded digits
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, None, True], rng.randint(1, 4))}
    if k == 5:
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]}
    return {"type": "string", "enum": ["yes", "no"]}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    k = rng.randrange(4) if depth < 2 else 0
    if k == 1:
        return {"type": "array", "items": _node(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if k == 2:
        return _object(rng, depth + 1)
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(_WORDS, rng.randint(1, 4))
    props = {key: _node(rng, depth) for key in keys}
    required = [key for key in keys if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schema_corpus(n: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]
