"""Owns what the explorer explores: the `Scenario` (shared state, thread bodies, invariant) and
how a TARGET string names one (`passcode:buggy`, `fixtures:lost_update`, `pkg.mod:name`,
`path/to/file.py:name`). It does not run anything."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isolab.errors import InvalidRequestError


@dataclass(frozen=True)
class Scenario:
    """Two or more threads over one shared state, and what must hold when they are done.

    setup() runs first, on the explorer's thread, with threading.Lock & co. already modelled, so
    the locks it builds are ones the scheduler controls. Each thread body gets the state and
    returns a value; check(state, results) returns None when all is well, otherwise one sentence
    saying what went wrong.
    """

    name: str
    setup: Callable[[], Any]
    threads: tuple[Callable[[Any], Any], ...]
    check: Callable[[Any, tuple[Any, ...]], str | None]
    thread_names: tuple[str, ...] = ()  # default T0, T1, ...
    watch: Callable[[Any], str] | None = None  # the shared value(s) shown in the narrative
    trace_modules: tuple[str, ...] = ()  # modules traced beyond those that define the callables
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.threads) < 1:
            raise InvalidRequestError(f"scenario {self.name} has no threads", field="threads")
        if self.thread_names and len(self.thread_names) != len(self.threads):
            raise InvalidRequestError(f"scenario {self.name}: one name per thread", field="thread_names")

    @property
    def names(self) -> tuple[str, ...]:
        return self.thread_names or tuple(f"T{i}" for i in range(len(self.threads)))

    def target_files(self) -> frozenset[str]:
        """Files whose frames are traced: where setup, the bodies and trace_modules live."""
        files: set[str] = set()
        fns: tuple[Callable[..., Any], ...] = (self.setup, *self.threads)
        for fn in fns:
            code = getattr(inspect.unwrap(fn), "__code__", None)
            if code is not None:
                files.add(code.co_filename)
        for name in self.trace_modules:
            module = sys.modules.get(name) or importlib.import_module(name)
            module_file = getattr(module, "__file__", None)
            if module_file:
                files.add(module_file)
        return frozenset(files)


BUILTIN_GROUPS = {"passcode": "isolab.race.scenarios", "fixtures": "isolab.race.fixtures"}


def builtin_names() -> list[str]:
    names: list[str] = []
    for group, module_name in BUILTIN_GROUPS.items():
        module = importlib.import_module(module_name)
        names += [f"{group}:{n}" for n in module.SCENARIOS]
    return names


def load(target: str) -> Scenario:
    """Resolves a TARGET string to a Scenario (or a zero-argument callable returning one)."""
    head, sep, attr = target.rpartition(":")
    if not sep or not head or not attr:
        raise InvalidRequestError(f"target {target!r} must look like 'module:name' or 'file.py:name'")
    if head in BUILTIN_GROUPS:
        module = importlib.import_module(BUILTIN_GROUPS[head])
        if attr not in module.SCENARIOS:
            raise InvalidRequestError(f"no scenario {target!r}; built in: {', '.join(builtin_names())}")
        return module.SCENARIOS[attr]()
    if head.endswith(".py"):
        path = Path(head)
        if not path.is_file():
            raise InvalidRequestError(f"no such file: {head}")
        spec = importlib.util.spec_from_file_location(f"isolab_target_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(head)
        except ImportError as exc:
            raise InvalidRequestError(f"cannot import {head!r}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise InvalidRequestError(f"{head} has no attribute {attr!r}")
    if not isinstance(obj, Scenario) and callable(obj):
        obj = obj()
    if not isinstance(obj, Scenario):
        raise InvalidRequestError(f"{target} is not a Scenario nor a function returning one")
    return obj


def labels(mapping: Sequence[tuple[object, str]]) -> Callable[[object], str]:
    """A masker for narrative values: known secrets become labels, anything else a short repr."""
    table = dict(mapping)

    def show(value: object) -> str:
        try:
            if value in table:
                return table[value]
        except TypeError:
            pass
        text = repr(value)
        return text if len(text) <= 24 else text[:21] + "..."

    return show

