"""Owns which code the explorer traces: the modules a scenario's functions reach (transitively,
outside the standard library and site-packages), the files whose frames are traced, the modules
left untraced, and the names traced code only ever reads. Does not know the Scenario type
(scenario.py asks it, passing functions and module names) and runs nothing.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from isolab.errors import InvalidRequestError
from isolab.race.explorer.types import EXPLORER_DIR


def roots(fns: Iterable[Callable[..., Any]], trace_modules: Iterable[str]) -> list[types.ModuleType]:
    """The modules that define `fns`, and the ones named by `trace_modules`."""
    modules = []
    for fn in fns:
        module = sys.modules.get(getattr(inspect.unwrap(fn), "__module__", "") or "")
        if module is not None:
            modules.append(module)
    return modules + [import_module(name) for name in trace_modules]


def target_files(fns: Iterable[Callable[..., Any]], root_modules: list[types.ModuleType],
                 trace_modules: tuple[str, ...], trace_dirs: tuple[str, ...]) -> frozenset[str]:
    """Files whose frames are traced: where `fns` are defined, the traceable modules the roots
    reach, the ones named by `trace_modules`, and every loaded module under `trace_dirs`."""
    files: set[str] = set()
    for fn in fns:
        code = getattr(inspect.unwrap(fn), "__code__", None)
        if code is not None:
            files.add(code.co_filename)
    for module in closure(root_modules):
        module_file = getattr(module, "__file__", None)
        if module_file and (traceable(module) or module.__name__ in trace_modules):
            files.add(module_file)
    for folder in trace_dirs:
        for module in list(sys.modules.values()):
            module_file = getattr(module, "__file__", None) or ""
            if module_file.startswith(folder + os.sep) and not _excluded(module_file):
                files.add(module_file)
    return frozenset(files)


def readonly_names(files: Iterable[str]) -> frozenset[tuple[str, str]]:
    """("attr"|"global"|"deref", name) for every name the code in `files` loads but never stores
    or deletes (see Scenario.readonly_names); empty when a file cannot be read or writes names
    indirectly."""
    loads: set[tuple[str, str]] = set()
    stores: set[tuple[str, str]] = set()
    for path in files:
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
                        str(ins.argval) in INDIRECT_WRITERS:
                    return frozenset()
    return frozenset(loads - stores)


def untraced(root_modules: list[types.ModuleType], traced: frozenset[str]) -> tuple[str, ...]:
    """Modules outside the standard library that the roots' code imports but whose files are not
    in `traced` (site-packages, unless named by trace_modules)."""
    names = set()
    for module in closure(root_modules):
        for value in list(vars(module).values()):
            other = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", "") or "")
            path = getattr(other, "__file__", None) if other is not None else None
            if other is None or not path or path in traced or _stdlib(path) or _explorer(path):
                continue
            names.add(other.__name__)
    return tuple(sorted(names))


# Reached often, never a finding's place: the modelled primitives' own modules (their locking is
# modelled, their code is not traced), and what an import or a class statement runs.
_QUIET_REACHED = frozenset({"threading", "queue", "importlib", "abc", "typing", "enum", "weakref", "_weakrefset",
                            "contextlib", "functools", "dataclasses", "codecs", "encodings"})


def reached_modules(files: set[str], known: tuple[str, ...]) -> tuple[str, ...]:
    """The modules of `files` (Python code traced code called at run time and the explorer did not
    trace: the standard library, a module imported inside a function), less `known` ones and the
    quiet ones above."""
    by_file = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            by_file[path] = module.__name__
    names = set()
    for path in files:
        name = by_file.get(path)
        if name is None or _explorer(path) or name.split(".")[0] in _QUIET_REACHED or name in known:
            continue
        names.add(name)
    return tuple(sorted(names))


_NAME_KINDS = {"LOAD_ATTR": "attr", "LOAD_METHOD": "attr", "STORE_ATTR": "attr", "DELETE_ATTR": "attr",
               "LOAD_GLOBAL": "global", "STORE_GLOBAL": "global", "DELETE_GLOBAL": "global",
               "STORE_NAME": "global", "DELETE_NAME": "global",
               "LOAD_DEREF": "deref", "STORE_DEREF": "deref", "DELETE_DEREF": "deref"}
INDIRECT_WRITERS = frozenset({"setattr", "delattr", "__dict__", "globals", "vars", "__setattr__", "__delattr__"})


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


def traceable(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return bool(path) and str(path).endswith(".py") and not _excluded(str(path))


def closure(modules: list[types.ModuleType], follow_untraced: bool = False, limit: int = 200) -> list[types.ModuleType]:
    """The modules and the traceable modules they import, transitively (through module globals:
    `import x`, `from x import f`)."""
    seen: dict[str, types.ModuleType] = {}
    stack = list(modules)
    while stack and len(seen) < limit:
        module = stack.pop()
        if module.__name__ in seen:
            continue
        seen[module.__name__] = module
        for value in list(vars(module).values()):
            other = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", "") or "")
            if other is not None and other.__name__ not in seen and (follow_untraced or traceable(other)):
                stack.append(other)
    return list(seen.values())


def import_module(name: str) -> types.ModuleType:
    try:
        return sys.modules.get(name) or importlib.import_module(name)
    except ImportError as exc:
        raise InvalidRequestError(f"cannot import module {name!r} to trace it: {exc}") from None
