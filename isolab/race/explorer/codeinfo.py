"""Owns the per-code tables the tracer reads: for each code object, every offset's opcode, whether
it is visible to other threads, its footprint token and whether CPython 3.11 checks the eval
breaker after it; the calls that skip that check; and the loads that fetch a primitive about to be
acquired or waited on (so a thread parked there can be known to block). Does not trace or schedule.

Built once per code object and kept across a scenario's executions (Scenario.code_infos)."""

from __future__ import annotations

import dis
from dataclasses import dataclass, field
from typing import Any

from isolab.race.explorer import footprint, gil

# What a primitive operation is called through: `with X:` acquires, `X.acquire()`, `X.wait()`.
_PRIMITIVE_METHODS = {"acquire": "acquire", "wait": "wait", "__enter__": "acquire"}
_CHAIN_LOADS = frozenset({"LOAD_FAST", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_ATTR"})


@dataclass
class CodeInfo:
    """Per code object: each offset's (opname, argrepr, visible, footprint token), the calls
    3.11 runs without a check, and the loads that fetch a primitive about to be acquired or
    waited on."""

    ops: dict[int, tuple[str, str, bool, footprint.Token | None, int]]  # ... and 1/2: check after / if taken
    unchecked_calls: frozenset[int]
    primitive_sites: dict[int, tuple[tuple[tuple[str, str], ...], str]] = field(default_factory=dict)


# Loads of a name that no traced code ever stores: they read a binding made before the threads
# started (`s.lock`, `self.items`, a module global), so they commute with every step of every
# thread and need no choice point (scenario.Scenario.readonly_names decides which names).
_READ_OPCODES = {"LOAD_ATTR": "attr", "LOAD_METHOD": "attr", "LOAD_GLOBAL": "global", "LOAD_DEREF": "deref"}


def code_info(code: Any, readonly: frozenset[tuple[str, str]] = frozenset()) -> CodeInfo:
    instructions = list(dis.get_instructions(code))
    ops = {}
    for ins in instructions:
        visible = ins.opname not in gil.LOCAL_OPCODES and (_READ_OPCODES.get(ins.opname), str(ins.argval)) not in readonly
        after = 1 if ins.opname in gil.CHECK_AFTER else 2 if ins.opname in gil.CHECK_AFTER_IF_TAKEN else 0
        ops[ins.offset] = (ins.opname, ins.argrepr, visible,
                           footprint.token(ins.opname, str(ins.argval), ins.argrepr) if visible else None, after)
    unchecked: set[int] = set()
    sites: dict[int, tuple[tuple[tuple[str, str], ...], str]] = {}
    for j, ins in enumerate(instructions):
        if ins.opname == "PRECALL":
            callee = _callee_load(instructions, j, ins.arg or 0)
            if callee is not None and callee.opname == "LOAD_GLOBAL" and str(callee.argval) in footprint.PURE_CALLS \
                    and ("global", str(callee.argval)) in readonly:
                call = next((i for i in instructions[j + 1:j + 3] if i.opname == "CALL"), None)
                if call is not None:  # range(3), isinstance(x, T): nothing shared is read or written
                    ops[call.offset] = (call.opname, call.argrepr, False, None, ops[call.offset][4])
            if callee is not None and gil.unchecked_class_call(callee.argrepr, ins.arg or 0):
                nxt = next((i for i in instructions[j + 1:] if i.opname == "CALL"), None)
                if nxt is not None:
                    unchecked.add(nxt.offset)
        site = _primitive_site(instructions, j)
        if site is not None:
            offsets, chain, op = site
            for offset in offsets:
                sites[offset] = (chain, op)
    for offset in unchecked:  # type(x) & co.: CALL without its eval-breaker check
        ops[offset] = ops[offset][:4] + (0,)
    return CodeInfo(ops, frozenset(unchecked), sites)


def _primitive_site(instructions: list[dis.Instruction],
                    j: int) -> tuple[list[int], tuple[tuple[str, str], ...], str] | None:
    """When instruction j is `with X:` or a call `X.acquire()` / `X.wait()` with no arguments
    (one that waits with no timeout): the offsets from the loads of X to the call, the chain of
    loads that fetch X, and the operation. A call with arguments may not wait at all
    (`acquire(False)`) or wait with a timeout: it gets no site, so nothing parks it."""
    ins = instructions[j]
    if ins.opname == "BEFORE_WITH":
        op = "acquire"
    elif ins.opname == "LOAD_METHOD" and ins.argval in _PRIMITIVE_METHODS:
        call = instructions[j + 1] if j + 1 < len(instructions) else None
        if call is None or call.opname != "PRECALL" or call.arg:
            return None
        op = _PRIMITIVE_METHODS[ins.argval]
    else:
        return None
    start = j
    while start > 0 and instructions[start - 1].opname in _CHAIN_LOADS:
        start -= 1
    if start == j or instructions[start].opname == "LOAD_ATTR":
        return None
    chain = tuple((i.opname, str(i.argval)) for i in instructions[start:j])
    offsets = [i.offset for i in instructions[start:j + 1]]
    if ins.opname == "LOAD_METHOD":  # ... PRECALL 0, CALL 0: the call itself too
        offsets += [i.offset for i in instructions[j + 1:j + 3] if i.opname in ("PRECALL", "CALL")]
    return offsets, chain, op


def _callee_load(instructions: list[dis.Instruction], precall: int, argc: int) -> dis.Instruction | None:
    """The instruction that pushed the callable of the PRECALL at `precall` (straight-line code)."""
    depth = 0
    for k in range(precall - 1, -1, -1):
        ins = instructions[k]
        if ins.opname.startswith(("POP_JUMP", "JUMP")) or ins.is_jump_target:
            return None
        depth += dis.stack_effect(ins.opcode, ins.arg) if ins.opcode >= dis.HAVE_ARGUMENT else dis.stack_effect(ins.opcode)
        if depth >= argc + 1:
            return ins
    return None


def _static_get(obj: Any, name: str) -> Any:
    """getattr without running any code (no properties, no __getattr__); None when unsure."""
    try:
        d = object.__getattribute__(obj, "__dict__")
        if name in d:
            return d[name]
    except AttributeError:
        pass
    for cls in type(obj).__mro__:
        if name in vars(cls):
            value = vars(cls)[name]
            return value if not hasattr(type(value), "__get__") else None
    return None


def resolve_chain(frame: Any, chain: tuple[tuple[str, str], ...]) -> Any:
    obj: Any = None
    for opname, name in chain:
        if opname in ("LOAD_FAST", "LOAD_DEREF"):
            obj = frame.f_locals.get(name)
        elif opname == "LOAD_GLOBAL":
            obj = frame.f_globals.get(name, frame.f_builtins.get(name))
        else:
            obj = _static_get(obj, name) if obj is not None else None
        if obj is None:
            return None
    return obj
