"""Owns how the explorer names things a person reads: a modelled object by the attribute path
that holds it (`s.a`, `s.locks[0]`), stable across executions because it depends on the state's
shape, not on creation counters; and where a stuck thread stands (its frame, and the traced frame
that called it). Does not run or schedule anything."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from isolab.race.explorer.blocking import Primitive
from isolab.race.explorer.types import short_path


class Namer:
    """The names of one execution's modelled objects, each fixed the first time it is asked for."""

    def __init__(self, state_name: Callable[[], str]) -> None:
        self._state_name = state_name  # what the bodies call the shared state (asked only when needed)
        self._names: dict[int, str] = {}
        self._ordinals: Counter = Counter()

    def name_of(self, state: Any, obj: object, kind: str) -> str:
        """`s.a` for the lock at attribute `a` of the state the bodies call `s`; `Lock#2` (the
        second Lock this execution created) only when no attribute path reaches it."""
        key = id(obj)
        name = self._names.get(key)
        if name is None:
            name = find_path(state, obj, self._state_name()) or self._ordinal(obj, kind)
            self._names[key] = name
        return name

    def _ordinal(self, obj: object, kind: str) -> str:
        ordinal = getattr(obj, "_ordinal", None)
        if ordinal is None:
            self._ordinals[kind] += 1
            ordinal = self._ordinals[kind]
        return f"{kind}#{ordinal}"

    def created(self, obj: Primitive) -> None:
        """Numbers a primitive in creation order (deterministic per execution)."""
        self._ordinals[obj.kind] += 1
        obj._ordinal = self._ordinals[obj.kind]  # type: ignore[attr-defined]


def where(ident: int | None, targets: frozenset[str]) -> str:
    """Where a thread stands now: its innermost frame, and the traced frame that called it."""
    frame: Any = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "(its stack is not visible)"
    inner, user = frame, frame
    while user is not None and user.f_code.co_filename not in targets:
        user = user.f_back
    text = f"in {inner.f_code.co_name} at {short_path(inner.f_code.co_filename)}:{inner.f_lineno}"
    if user is not None and user is not inner:
        text += f", called from {short_path(user.f_code.co_filename)}:{user.f_lineno}"
    return text


def find_path(root: Any, target: object, root_name: str, max_nodes: int = 4000) -> str | None:
    """Breadth-first over attributes, dict values and sequence items from the state: the
    shortest path that holds `target`, written as Python would (`s.locks[0]`, `s.table['k']`)."""
    if root is target:
        return root_name
    seen = {id(root)}
    frontier: list[tuple[Any, str]] = [(root, root_name)]
    visited = 0
    for _depth in range(4):
        nxt: list[tuple[Any, str]] = []
        for obj, path in frontier:
            for child, child_path in _children(obj, path):
                if child is target:
                    return child_path
                visited += 1
                if id(child) in seen or visited > max_nodes or isinstance(child, (str, bytes, int, float, type)):
                    continue
                seen.add(id(child))
                nxt.append((child, child_path))
        frontier = nxt
    return None


def _children(obj: Any, path: str) -> list[tuple[Any, str]]:
    if isinstance(obj, dict):
        return [(v, f"{path}[{k!r}]") for k, v in list(obj.items())[:64]]
    if isinstance(obj, (list, tuple)):
        return [(v, f"{path}[{i}]") for i, v in enumerate(obj[:64])]
    if isinstance(obj, Primitive) or callable(obj) and not hasattr(obj, "__dict__"):
        return []
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return []
    return [(v, f"{path}.{k}") for k, v in list(attrs.items())[:64] if not k.startswith("__")]
