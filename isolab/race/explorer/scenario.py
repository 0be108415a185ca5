"""Owns what the explorer explores: the `Scenario` (shared state, thread bodies, invariant) and how
a TARGET string names one (`passcode:buggy`, `fixtures:lost_update`, `pkg.mod:name`,
`path/to/file.py:name`). It does not run anything, and asks scope.py which code is traced.

What is traced, by default: the files that define setup and the bodies, the folder of a file
target, and every module those import (directly or through each other) that lives outside the
standard library and site-packages; `trace_modules` (`--trace-module`) adds more. The rest is
listed by `untraced()` so a report can say what the explorer could not see.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from isolab.errors import InvalidRequestError
from isolab.race.explorer import scope


def _check_callable(scenario: str, what: str, fn: Any, args: tuple[Any, ...]) -> None:
    """A body, setup or check that cannot be called as the explorer calls it: one sentence now
    (a body of the wrong arity was reported as a race, 'T1 raised TypeError'; a generator body
    never ran its code)."""
    if not callable(fn):
        raise InvalidRequestError(f"scenario {scenario}: {what} is a {type(fn).__name__}, not a function",
                                  field="threads")
    if inspect.isgeneratorfunction(inspect.unwrap(fn)) or inspect.isasyncgenfunction(inspect.unwrap(fn)):
        raise InvalidRequestError(f"scenario {scenario}: {what} is a generator function: calling it runs none of "
                                  "its code (drop the yield, or loop over it inside a plain function)", field="threads")
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        want = {0: "no arguments", 1: "one argument, the state", 2: "two arguments, the state and the results"}
        raise InvalidRequestError(f"scenario {scenario}: {what} must take {want[len(args)]} ({exc})",
                                  field="threads") from None
    except ValueError:
        pass  # a builtin without a signature: its first call says


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
    trace_modules: tuple[str, ...] = ()  # modules traced beyond the default (see the module docstring)
    description: str = ""
    trace_dirs: tuple[str, ...] = ()  # folders whose files are all traced (a file target's folder)
    target: str = ""  # the TARGET string it was loaded from, when it was

    def __post_init__(self) -> None:
        if len(self.threads) < 1:
            raise InvalidRequestError(f"scenario {self.name} has no threads", field="threads")
        if self.thread_names and len(self.thread_names) != len(self.threads):
            raise InvalidRequestError(f"scenario {self.name}: one name per thread", field="thread_names")
        if len(set(self.names)) < len(self.names):  # a schedule names its threads: two alike could not replay
            raise InvalidRequestError(f"scenario {self.name}: thread names {', '.join(self.names)} are not all "
                                      "different", field="thread_names")
        for name, fn, args in (("setup", self.setup, ()), ("check", self.check, (None, ())),
                               *((f"thread {n}", body, (None,)) for n, body in zip(self.names, self.threads,
                                                                                    strict=True))):
            _check_callable(self.name, name, fn, args)
        for name in self.trace_modules:
            scope.import_module(name)

    @property
    def names(self) -> tuple[str, ...]:
        return self.thread_names or tuple(f"T{i}" for i in range(len(self.threads)))

    def state_name(self) -> str:
        """What the bodies call the shared state (their first parameter), for naming objects."""
        code = getattr(inspect.unwrap(self.threads[0]), "__code__", None)
        return code.co_varnames[0] if code is not None and code.co_argcount else "state"

    def _functions(self) -> tuple[Callable[..., Any], ...]:
        return (self.setup, *self.threads)

    def _roots(self) -> list[types.ModuleType]:
        return scope.roots(self._functions(), self.trace_modules)

    def traced_module_names(self) -> tuple[str, ...]:
        return self._traced_module_names

    @cached_property
    def _traced_module_names(self) -> tuple[str, ...]:
        return tuple(sorted(m.__name__ for m in scope.closure(self._roots()) if scope.traceable(m)))

    def target_files(self) -> frozenset[str]:
        """Files whose frames are traced."""
        return self._target_files

    @cached_property
    def _target_files(self) -> frozenset[str]:
        return scope.target_files(self._functions(), self._roots(), self.trace_modules, self.trace_dirs)

    @cached_property
    def reached_files(self) -> set[str]:
        """Files of untraced Python code that traced code called, gathered over the executions."""
        return set()

    def reached_untraced(self) -> tuple[str, ...]:
        """Modules the executions reached without tracing them that untraced() could not name before
        running: the standard library's Python code (collections.Counter.update) and modules
        imported at run time. A race inside them is not explored."""
        return scope.reached_modules(self.reached_files, self.untraced())

    @cached_property
    def code_infos(self) -> dict[Any, Any]:
        """codeinfo.CodeInfo per code object, kept across this scenario's executions."""
        return {}

    @cached_property
    def readonly_names(self) -> frozenset[tuple[str, str]]:
        """("attr"|"global"|"deref", name) for every name that traced code loads but never stores
        or deletes: a load of one reads a binding made before the threads started, so it needs
        no choice point. `self.x = ...` inside `__init__` does not count as a store: an object is
        assumed not to be shared before its __init__ returns. Empty (no reduction) when a traced
        file cannot be read or its code writes attributes or globals indirectly (setattr,
        delattr, __dict__, globals(), vars())."""
        return scope.readonly_names(self.target_files())

    def untraced(self) -> tuple[str, ...]:
        """Modules outside the standard library that traced code imports but the explorer does
        not trace (site-packages, unless named by trace_modules). The standard library is never
        traced; its primitives are modelled instead."""
        return scope.untraced(self._roots(), self.target_files())


BUILTIN_GROUPS = {"passcode": "isolab.race.scenarios", "fixtures": "isolab.race.fixtures",
                  "workloads": "isolab.race.workloads"}


def builtin_names() -> list[str]:
    names: list[str] = []
    for group, module_name in BUILTIN_GROUPS.items():
        module = importlib.import_module(module_name)
        names += [f"{group}:{n}" for n in module.SCENARIOS]
    return names


def load(target: str, trace_modules: Sequence[str] = ()) -> Scenario:
    """Resolves a TARGET string to a Scenario (or a zero-argument callable returning one). Every
    way a target can be wrong is an InvalidRequestError with one sentence."""
    head, sep, attr = target.rpartition(":")
    if not sep or not head or not attr:
        raise InvalidRequestError(f"target {target!r} must look like 'module:name' or 'file.py:name'")
    trace_dirs: tuple[str, ...] = ()
    if head in BUILTIN_GROUPS:
        module = importlib.import_module(BUILTIN_GROUPS[head])
        if attr not in module.SCENARIOS:
            raise InvalidRequestError(f"no scenario {target!r}; built in: {', '.join(builtin_names())}")
        obj: Any = module.SCENARIOS[attr]
    else:
        if head.endswith(".py"):
            module = _load_file(Path(head))
            trace_dirs = (os.path.dirname(os.path.abspath(head)),)
        else:
            try:
                module = _import_here(head)
            except (Exception, SystemExit) as exc:  # ImportError, or the module's own error on import
                raise InvalidRequestError(f"cannot import {head!r}: {_one_line(exc)}") from None
        obj = getattr(module, attr, None)
        if obj is None:
            raise InvalidRequestError(f"{head} has no attribute {attr!r}")
    if not isinstance(obj, Scenario) and callable(obj):
        try:
            obj = obj()
        except InvalidRequestError:
            raise
        except (Exception, SystemExit) as exc:
            raise InvalidRequestError(f"{target} raised while building the scenario: {_one_line(exc)}") from None
    if not isinstance(obj, Scenario):
        raise InvalidRequestError(f"{target} is not a Scenario nor a function returning one (got {type(obj).__name__})")
    from dataclasses import replace

    extra = tuple(m for m in trace_modules if m not in obj.trace_modules)
    return replace(obj, trace_modules=obj.trace_modules + extra, trace_dirs=obj.trace_dirs + trace_dirs,
                   target=target)


def _import_here(name: str) -> types.ModuleType:
    """import `name`; a package in the current folder is found as `python -m` finds it (the
    `isolab` script does not put the folder on sys.path: 'No module named mypkg')."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != name.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        try:
            return importlib.import_module(name)
        except BaseException:
            sys.path.remove(here)  # (not found here either: the folder goes back off the path)
            raise


def _load_file(path: Path) -> types.ModuleType:
    if not path.is_file():
        raise InvalidRequestError(f"no such file: {path}")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # sibling imports (`import helpers`) resolve as they would when run
        sys.path.insert(0, folder)
    name = f"isolab_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        raise InvalidRequestError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except (Exception, SystemExit) as exc:  # (SystemExit at import ended the tool with its code, silently)
        sys.modules.pop(name, None)
        raise InvalidRequestError(f"cannot load {path}: {_one_line(exc)}") from None
    return module


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


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
