"""Owns the CPython model: which bytecodes touch only a frame's own locals, and exactly where a
thread holding the GIL can lose it; does not trace or schedule (tracer.py, codeinfo.py read it).
It covers CPython 3.11 only; `check_supported` refuses others.

Derived from CPython 3.11's eval loop (Python/ceval.c) and checked against the interpreter itself
by tests/race/test_gil_model.py, which runs two real threads with a 1 us switch interval around a
gadget placed between a read and a write of a shared counter, and asserts that updates are lost
exactly when this table says the gadget holds a switch point:

    switch point (eval-breaker check)         gadget in the stress test        lost updates
    function entry (RESUME 0/1)               a call to a Python function      yes
    after JUMP_BACKWARD                       for _ in (1, 2): pass            yes
    after a taken POP_JUMP_BACKWARD_IF_TRUE   while i: i -= 1                  yes
      ... _IF_FALSE / _IF_NONE / _IF_NOT_NONE while not i > 0 / is None ...    yes
    after CALL / CALL_FUNCTION_EX             abs(1), str(v), d.get(1) ...     yes
    NOT after the calls 3.11 specialises      len(()), isinstance(v, int),     no
      without a check                         type(v), a_list.append(1)
    nothing between the read and the write    v = s.x; s.x = v + 1             no
    an uncontended Lock/RLock acquire/release with s.a: with s.b: (C locks)    no deadlock
    a blocking call that waits                a contended acquire, wait, sleep yes (GIL released)

Python-level primitives (Condition, Event, Semaphore, Barrier, queue.Queue) are Python code, so
entering any of their methods is a switch point. A Python-to-Python call is inlined by 3.11, so
returning from it is not a switch point; a call through a C slot (`__init__`, `__eq__`, other
dunders) returns through CALL's check, so it is. Two known gaps, both over-approximations (the
model may call a schedule GIL-reachable that needs rare timing): the first ~8 runs of a
function's code are unspecialised, and there `len()` & co. do check; a generator resumed after
`await`/`yield from` (RESUME 2/3) does not check but is treated as entry.
"""

from __future__ import annotations

import sys

from isolab.errors import InvalidRequestError

SUPPORTED = ((3, 11),)


def check_supported(version: tuple[int, int] | None = None) -> None:
    """Refuses interpreters whose bytecode this model was not derived from."""
    major, minor = version or sys.version_info[:2]
    if (major, minor) not in SUPPORTED:
        raise InvalidRequestError(
            f"the explorer models CPython 3.11's bytecode and GIL switch points; this is Python "
            f"{major}.{minor}, whose opcodes and eval-breaker checks differ, so its results would not be faithful"
        )


# Opcodes that read or write only the frame's own locals or stack. FOR_ITER is here so that a
# loop over a local iterator is free; iterating a shared container through a local alias is the
# documented blind spot (the load of the container itself is visible).
LOCAL_OPCODES = frozenset(
    {
        "NOP", "RESUME", "CACHE", "EXTENDED_ARG", "LOAD_FAST", "STORE_FAST", "DELETE_FAST",
        "LOAD_CONST", "POP_TOP", "COPY", "SWAP", "PUSH_NULL", "PRECALL", "KW_NAMES",
        "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "POP_JUMP_FORWARD_IF_FALSE",
        "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_TRUE",
        "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NONE",
        "POP_JUMP_BACKWARD_IF_NOT_NONE", "JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP",
        "FOR_ITER", "GET_ITER", "RETURN_VALUE", "UNARY_NOT", "MAKE_CELL", "COPY_FREE_VARS",
        "POP_EXCEPT", "PUSH_EXC_INFO", "RERAISE", "CHECK_EXC_MATCH",
    }
)
# Opcodes that store into or delete from shared state (the rest of the visible ones read).
WRITE_OPCODES = frozenset(
    {
        "STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_SUBSCR", "DELETE_SUBSCR",
        "STORE_DEREF", "DELETE_DEREF", "STORE_NAME", "DELETE_NAME",
    }
)
# After these, CPython 3.11 checks the eval breaker before the next instruction.
CHECK_AFTER = frozenset({"JUMP_BACKWARD", "CALL", "CALL_FUNCTION_EX"})
# ... and after these only when the jump is taken (a while loop's back edge).
CHECK_AFTER_IF_TAKEN = frozenset(
    {"POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_NONE",
     "POP_JUMP_BACKWARD_IF_NOT_NONE"}
)
# Builtins whose specialised PRECALL (PRECALL_NO_KW_LEN, _ISINSTANCE, _LIST_APPEND) skips the check.
_UNCHECKED_BUILTINS = frozenset({len, isinstance})


def c_call_checks(callee: object) -> bool:
    """Whether CPython 3.11 checks the eval breaker after calling the C function `callee`."""
    if callee in _UNCHECKED_BUILTINS:
        return False
    if getattr(callee, "__name__", None) == "append" and type(getattr(callee, "__self__", None)) is list:
        return False
    return True


def unchecked_class_call(argrepr: str, argc: int) -> bool:
    """`type(x)` is a class call (no c_call event) that 3.11 specialises without a check."""
    return argc == 1 and argrepr in ("NULL + type", "type")


def is_inlined(code_name: str) -> bool:
    """A Python function entered straight from CALL is inlined (no check when it returns);
    dunders are entered through C slots and return through CALL's check."""
    return not (code_name.startswith("__") and code_name.endswith("__"))
