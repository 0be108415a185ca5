"""Owns how the explorer names things a person reads: a modelled object by the attribute path
that holds it (`s.a`, `s.locks[0]`), stable across executions because it depends on the state's
shape, not on creation counters; and where a stuck thread stands (its frame, and the traced frame
that called it)."""

from __future__ import annotations

import sys
from typing import Any

from isolab.race.explorer.primitives import Primitive
from isolab.race.explorer.types import short_path


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
