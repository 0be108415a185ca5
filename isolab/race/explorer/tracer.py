"""Owns how bytecode becomes choice points: the `sys.settrace`/`sys.setprofile` hooks of a
managed thread, the per-code tables they read, and the narrative they record.

A *switch point* is where the switch model lets a thread lose the CPU:
    gil     exactly where CPython 3.11 with the GIL can (gil.py: function entry, after a loop
            back edge, after a checking call, at a blocking call)
    line    the start of every source line
    opcode  before every bytecode (a stand-in for free-threaded CPython)
A switch only matters before an operation another thread could observe: a *visible* opcode
(attribute, global, subscript, closure-cell access, calls, comparisons...) or a modelled
primitive's operation. Steps that touch only locals commute with everything, so a preemption at
a switch point is equivalent to one at the next visible operation. Hence:
    choice point = a visible operation reached after at least one switch point since the last.
The seed's `for _ in range(1000): pass` touches only locals and costs no choice points.

It is a mixin of runtime.Runtime (the hooks are hot; one object keeps attribute lookups short)
and knows nothing of how the next thread is chosen.
"""

from __future__ import annotations

import _thread
import dis
import linecache
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from isolab.race.explorer import footprint, gil
from isolab.race.explorer.primitives import Primitive
from isolab.race.explorer.types import EXPLORER_DIR, Abort, Outcome, Step, SwitchMode, short_path

if TYPE_CHECKING:
    from isolab.race.explorer.runtime import Task

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
        op = None
        if ins.opname == "BEFORE_WITH":
            op, end = "acquire", j
        elif ins.opname == "LOAD_METHOD" and ins.argval in _PRIMITIVE_METHODS:
            op, end = _PRIMITIVE_METHODS[ins.argval], j
        if op is None:
            continue
        start = end
        while start > 0 and instructions[start - 1].opname in _CHAIN_LOADS:
            start -= 1
        if start == end or instructions[start].opname == "LOAD_ATTR":
            continue
        chain = tuple((i.opname, str(i.argval)) for i in instructions[start:end])
        site_offsets = [i.offset for i in instructions[start:end + 1]]
        if ins.opname == "LOAD_METHOD":  # ... PRECALL n, CALL n: the call itself too
            site_offsets += [i.offset for i in instructions[j + 1:j + 3] if i.opname in ("PRECALL", "CALL")]
        for offset in site_offsets:
            sites[offset] = (chain, op)
    for offset in unchecked:  # type(x) & co.: CALL without its eval-breaker check
        ops[offset] = ops[offset][:4] + (0,)
    return CodeInfo(ops, frozenset(unchecked), sites)


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


class Tracer:
    """The hooks. Attributes below are owned by runtime.Runtime."""

    mode: SwitchMode
    touched: set[footprint.Token]
    record: bool
    aborted: bool
    silent: bool
    targets: frozenset[str]
    max_ops: int
    num_ops: int
    tasks: list[Task]
    steps: list[Step]

    def _init_tracer(self, info_cache: dict[Any, CodeInfo], readonly: frozenset[tuple[str, str]]) -> None:
        self._info_cache = info_cache  # shared by every execution of one scenario
        self._readonly = readonly
        self._seen_in_run: dict[int, dict[str, int]] = {}  # thread -> location -> step index

    def _info(self, code: Any) -> CodeInfo:
        info = self._info_cache.get(code)
        if info is None:
            info = self._info_cache[code] = code_info(code, self._readonly)
        return info

    # --- hooks, one set per managed thread ----------------------------------------------------
    def hooks(self, task: Task) -> tuple[Any, Any]:
        targets, opcode_mode, gil_mode = self.targets, self.mode is SwitchMode.OPCODE, self.mode is SwitchMode.GIL
        line_mode = self.mode is SwitchMode.LINE
        record = self.record
        explorer_prefix = EXPLORER_DIR + os.sep

        touched = self.touched
        pure = footprint.PURE_BUILTINS
        wildcard = footprint.WILDCARD

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call":
                if task.pending_frame is frame and not gil.c_call_checks(arg):
                    task.pending_frame = None
                if frame.f_code.co_filename in targets and arg not in pure:
                    tok = footprint.c_call_token(arg)  # a C function may change what it was given
                    if tok is not None:
                        touched.add(tok)

        def trace_call(frame: Any, event: str, arg: Any) -> Any:
            if self.aborted or self.silent:
                return None
            code = frame.f_code
            filename = code.co_filename
            back = frame.f_back
            traced = filename in targets
            if filename.startswith(explorer_prefix):
                return None  # the model's own code stands in for C (Lock) or is handled by sync_point
            if not traced:  # ... and so does what the model's code calls: find who called
                if back is not None and back.f_code.co_filename in targets:
                    touched.add(wildcard)  # untraced Python code called from traced code
                caller = back
                while caller is not None:
                    caller_file = caller.f_code.co_filename
                    if caller_file.startswith(explorer_prefix):
                        return None
                    if caller_file in targets:
                        break
                    caller = caller.f_back
            task.gil_permitted = task.permitted = True  # RESUME: a Python frame entered
            if task.pending_frame is not None and task.pending_frame is back and gil.is_inlined(code.co_name):
                task.pending_frame = None  # an inlined call returns without a check
            if not traced:
                return None
            frame.f_trace_opcodes = True
            return trace_local

        cache = self._info_cache
        max_ops = self.max_ops

        def trace_local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                if self.aborted:
                    raise Abort
                self.num_ops += 1
                if self.num_ops > max_ops:
                    self._no_progress_ops(task, frame)
                code = frame.f_code
                info = cache.get(code) or self._info(code)
                offset = frame.f_lasti
                opname, argrepr, visible, tok, after = info.ops.get(offset) or ("?", "", True, wildcard, 0)
                if task.pending_frame is frame:
                    task.gil_permitted = True
                    task.pending_frame = None
                elif task.jump_frame is frame:
                    if offset < task.jump_offset:
                        task.gil_permitted = True
                    task.jump_frame = None
                if opcode_mode:
                    task.permitted = True
                elif gil_mode:
                    task.permitted = task.gil_permitted
                if visible:
                    if task.permitted:
                        gil_ok = task.gil_permitted
                        task.permitted = task.gil_permitted = False
                        site = info.primitive_sites.get(offset)
                        self.choice(task, frame, f"{opname} {argrepr}".strip(), gil_ok,
                                    guard=self._site_guard(frame, site) if site else None)
                    if tok is not None:
                        touched.add(tok)
                if after:
                    if after == 1:
                        task.pending_frame = frame
                    else:
                        task.jump_frame, task.jump_offset = frame, offset
                return trace_local
            if self.aborted:
                raise Abort
            if event == "line":
                if line_mode:
                    task.permitted = True
                if record:
                    self._note_line(task, frame)
            elif event == "exception" and record:
                self._note_exception(task, arg)
            return trace_local

        return trace_call, profile

    def _site_guard(self, frame: Any, site: tuple[tuple[tuple[str, str], ...], str]) -> Any:
        chain, op = site
        primitive = resolve_chain(frame, chain)
        if not isinstance(primitive, Primitive):
            return None
        guard = primitive.guard(op)
        if guard is None:
            return None
        ready, why = guard

        def still(ready: Any = ready) -> bool:  # the thread would re-read the chain: check it still leads here
            return resolve_chain(frame, chain) is not primitive or ready()

        return still, why

    def _no_progress_ops(self, task: Task, frame: Any) -> None:
        where = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        self._end(Outcome.NO_PROGRESS,
                  f"{task.name} makes no progress: {self.max_ops:,} bytecodes in one execution, now at {where} "
                  "(a loop that never ends?)")
        raise Abort

    # --- narrative ----------------------------------------------------------------------------
    def _shared(self) -> str:
        raise NotImplementedError

    def _end(self, outcome: Outcome, message: str | None) -> None:
        raise NotImplementedError

    def choice(self, task: Task, frame: Any, what: str, gil_ok: bool, yielding: bool = False, guard: Any = None) -> None:
        raise NotImplementedError

    def _note_line(self, task: Task, frame: Any, resumed: bool = False) -> None:
        location = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        shared = self._shared()
        seen = self._seen_in_run.setdefault(task.index, {})
        if location in seen and not resumed:
            i = seen[location]
            s = self.steps[i] if i < len(self.steps) else None
            if s is not None and s.shared == shared and s.thread == task.index and not s.switch:
                self.steps[i] = Step(s.thread, s.location, s.source, s.shared, s.repeats + 1, s.switch, s.resumed)
                return
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        seen[location] = len(self.steps)
        self.steps.append(Step(task.index, location, source, shared, resumed=resumed))

    def _note_exception(self, task: Task, arg: Any) -> None:
        exc_type, exc, _ = arg
        task.last_exception = f"{exc_type.__name__}: {exc}"

    def _note_switch(self, task: Task, why: str) -> None:
        if not self.record:
            return
        self._seen_in_run[task.index] = {}
        for i in range(len(self.steps) - 1, -1, -1):
            if self.steps[i].thread == task.index:
                s = self.steps[i]
                if not s.switch:
                    self.steps[i] = Step(s.thread, s.location, s.source, s.shared, s.repeats, why, s.resumed)
                break


def current_ident() -> int:
    return _thread.get_ident()
