"""Owns what the explorer explores: the `Scenario` (shared state, thread bodies, invariant), which
code it traces, and how a TARGET string names one (`passcode:buggy`, `fixtures:lost_update`,
`pkg.mod:name`, `path/to/file.py:name`). It does not run anything.

What is traced, by default: the files that define setup and the bodies, the folder of a file
target, and every module those import (directly or through each other) that lives outside the
standard library and site-packages; `trace_modules` (`--trace-module`) adds more. The rest is
listed by `untraced()` so a report can say what the explorer could not see.
"""

from __future__ import annotations

import dis
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from isolab.errors import InvalidRequestError
from isolab.race.explorer.types import EXPLORER_DIR


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
        for name in self.trace_modules:
            _import(name)

    @property
    def names(self) -> tuple[str, ...]:
        return self.thread_names or tuple(f"T{i}" for i in range(len(self.threads)))

    def state_name(self) -> str:
        """What the bodies call the shared state (their first parameter), for naming objects."""
        code = getattr(inspect.unwrap(self.threads[0]), "__code__", None)
        return code.co_varnames[0] if code is not None and code.co_argcount else "state"

    def _roots(self) -> list[types.ModuleType]:
        modules = []
        fns: tuple[Callable[..., Any], ...] = (self.setup, *self.threads)
        for fn in fns:
            module = sys.modules.get(getattr(inspect.unwrap(fn), "__module__", "") or "")
            if module is not None:
                modules.append(module)
        return modules + [_import(name) for name in self.trace_modules]

    def traced_module_names(self) -> tuple[str, ...]:
        return self._traced_module_names

    @cached_property
    def _traced_module_names(self) -> tuple[str, ...]:
        return tuple(sorted(m.__name__ for m in _closure(self._roots()) if _traceable(m)))

    def target_files(self) -> frozenset[str]:
        """Files whose frames are traced."""
        return self._target_files

    @cached_property
    def _target_files(self) -> frozenset[str]:
        files: set[str] = set()
        fns: tuple[Callable[..., Any], ...] = (self.setup, *self.threads)
        for fn in fns:
            code = getattr(inspect.unwrap(fn), "__code__", None)
            if code is not None:
                files.add(code.co_filename)
        for module in _closure(self._roots()):
            module_file = getattr(module, "__file__", None)
            if module_file and (_traceable(module) or module.__name__ in self.trace_modules):
                files.add(module_file)
        for folder in self.trace_dirs:
            for module in list(sys.modules.values()):
                module_file = getattr(module, "__file__", None) or ""
                if module_file.startswith(folder + os.sep) and not _excluded(module_file):
                    files.add(module_file)
        return frozenset(files)

    @cached_property
    def code_infos(self) -> dict[Any, Any]:
        """tracer.CodeInfo per code object, kept across this scenario's executions."""
        return {}

    @cached_property
    def readonly_names(self) -> frozenset[tuple[str, str]]:
        """("attr"|"global"|"deref", name) for every name that traced code loads but never stores
        or deletes: a load of one reads a binding made before the threads started, so it needs
        no choice point. `self.x = ...` inside `__init__` does not count as a store: an object is
        assumed not to be shared before its __init__ returns. Empty (no reduction) when a traced
        file cannot be read or its code writes attributes or globals indirectly (setattr,
        delattr, __dict__, globals(), vars())."""
        loads: set[tuple[str, str]] = set()
        stores: set[tuple[str, str]] = set()
        for path in self.target_files():
            try:
                code = compile(Path(path).read_text(), path, "exec")
            except (OSError, SyntaxError, ValueError):
                return frozenset()
            for c in _code_objects(code):
                instructions = list(dis.get_instructions(c))
                for k, ins in enumerate(instructions):
                    kind = _NAME_KINDS.get(ins.opname)
                    if kind is None:
                        continue
                    if not ins.opname.startswith(("STORE", "DELETE")):
                        loads.add((kind, str(ins.argval)))
                    elif not _initialises_self(c, instructions, k):
                        stores.add((kind, str(ins.argval)))
                    if ins.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME") and \
                            str(ins.argval) in _INDIRECT_WRITERS:
                        return frozenset()
        return frozenset(loads - stores)

    def untraced(self) -> tuple[str, ...]:
        """Modules outside the standard library that traced code imports but the explorer does
        not trace (site-packages, unless named by trace_modules). The standard library is never
        traced; its primitives are modelled instead."""
        traced = self.target_files()
        names = set()
        for module in _closure(self._roots()):
            for value in list(vars(module).values()):
                other = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", "") or "")
                path = getattr(other, "__file__", None) if other is not None else None
                if other is None or not path or path in traced or _stdlib(path) or _explorer(path):
                    continue
                names.add(other.__name__)
        return tuple(sorted(names))


_NAME_KINDS = {"LOAD_ATTR": "attr", "LOAD_METHOD": "attr", "STORE_ATTR": "attr", "DELETE_ATTR": "attr",
               "LOAD_GLOBAL": "global", "STORE_GLOBAL": "global", "DELETE_GLOBAL": "global",
               "STORE_NAME": "global", "DELETE_NAME": "global",
               "LOAD_DEREF": "deref", "STORE_DEREF": "deref", "DELETE_DEREF": "deref"}
_INDIRECT_WRITERS = frozenset({"setattr", "delattr", "__dict__", "globals", "vars", "__setattr__", "__delattr__"})


def _initialises_self(code: types.CodeType, instructions: list[dis.Instruction], k: int) -> bool:
    """`self.x = value` directly inside an __init__ (the object is not shared yet)."""
    if code.co_name != "__init__" or instructions[k].opname != "STORE_ATTR" or k == 0 or not code.co_argcount:
        return False
    owner = instructions[k - 1]
    return owner.opname == "LOAD_FAST" and owner.argval == code.co_varnames[0]


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    out, stack = [], [code]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


_STDLIB = {os.path.realpath(p) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}}


def _stdlib(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    return "site-packages" not in parts and any(real.startswith(p + os.sep) for p in _STDLIB)


def _explorer(path: str) -> bool:
    return os.path.realpath(path).startswith(EXPLORER_DIR + os.sep)


def _excluded(path: str) -> bool:
    """Standard library, site-packages and the explorer itself are never traced by default."""
    real = os.path.realpath(path)
    if "site-packages" in real.split(os.sep) or "dist-packages" in real.split(os.sep):
        return True
    if real.startswith(EXPLORER_DIR + os.sep):
        return True
    return any(real.startswith(p + os.sep) for p in _STDLIB)


def _traceable(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return bool(path) and str(path).endswith(".py") and not _excluded(str(path))


def _closure(roots: list[types.ModuleType], follow_untraced: bool = False, limit: int = 200) -> list[types.ModuleType]:
    """The roots and the traceable modules they import, transitively (through module globals:
    `import x`, `from x import f`)."""
    seen: dict[str, types.ModuleType] = {}
    stack = list(roots)
    while stack and len(seen) < limit:
        module = stack.pop()
        if module.__name__ in seen:
            continue
        seen[module.__name__] = module
        for value in list(vars(module).values()):
            other = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", "") or "")
            if other is not None and other.__name__ not in seen and (follow_untraced or _traceable(other)):
                stack.append(other)
    return list(seen.values())


def _import(name: str) -> types.ModuleType:
    try:
        return sys.modules.get(name) or importlib.import_module(name)
    except ImportError as exc:
        raise InvalidRequestError(f"cannot import module {name!r} to trace it: {exc}") from None


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
                module = importlib.import_module(head)
            except Exception as exc:  # ImportError, or the module's own error on import
                raise InvalidRequestError(f"cannot import {head!r}: {_one_line(exc)}") from None
        obj = getattr(module, attr, None)
        if obj is None:
            raise InvalidRequestError(f"{head} has no attribute {attr!r}")
    if not isinstance(obj, Scenario) and callable(obj):
        try:
            obj = obj()
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise InvalidRequestError(f"{target} raised while building the scenario: {_one_line(exc)}") from None
    if not isinstance(obj, Scenario):
        raise InvalidRequestError(f"{target} is not a Scenario nor a function returning one (got {type(obj).__name__})")
    from dataclasses import replace

    extra = tuple(m for m in trace_modules if m not in obj.trace_modules)
    return replace(obj, trace_modules=obj.trace_modules + extra, trace_dirs=obj.trace_dirs + trace_dirs,
                   target=target)


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
    except Exception as exc:
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
