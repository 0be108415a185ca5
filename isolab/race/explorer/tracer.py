"""Owns how bytecode becomes choice points: the `sys.settrace`/`sys.setprofile` hooks of a
managed thread; does not know how the next thread is chosen (scheduling.py) nor how the per-code
tables are built (codeinfo.py).

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

It is a mixin of runtime.Runtime (the hooks are hot; one object keeps attribute lookups short):
it calls `choice`, which scheduling.Scheduling (the class above it) implements.
"""

from __future__ import annotations

import os
from typing import Any

from isolab.race.explorer import footprint, gil
from isolab.race.explorer.blocking import Primitive
from isolab.race.explorer.codeinfo import CodeInfo, code_info, resolve_chain
from isolab.race.explorer.narrative import Recorder
from isolab.race.explorer.task import Task
from isolab.race.explorer.types import EXPLORER_DIR, Abort, Outcome, SwitchMode, short_path


class Tracer(Recorder):
    """The hooks. Attributes below are owned by runtime.Runtime."""

    mode: SwitchMode
    touched: set[footprint.Token]
    aborted: bool
    silent: bool
    targets: frozenset[str]
    reached: set[str]
    max_ops: int
    num_ops: int

    def _init_tracer(self, info_cache: dict[Any, CodeInfo], readonly: frozenset[tuple[str, str]]) -> None:
        self._info_cache = info_cache  # shared by every execution of one scenario
        self._readonly = readonly
        self._init_recorder()

    def _info(self, code: Any) -> CodeInfo:
        info = self._info_cache.get(code)
        if info is None:
            info = self._info_cache[code] = code_info(code, self._readonly)
        return info

    # --- hooks, one set per managed thread ----------------------------------------------------
    def hooks(self, task: Task) -> tuple[Any, Any]:
        """(the settrace hook, the setprofile hook) for one managed thread."""
        return self._call_hook(task, self._opcode_hook(task)), self._profile_hook(task)

    def _profile_hook(self, task: Task) -> Any:
        """C calls: some return without CPython's eval-breaker check; any may change its arguments."""
        targets, touched, pure = self.targets, self.touched, footprint.PURE_BUILTINS

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call":
                if task.pending_frame is frame and not gil.c_call_checks(arg):
                    task.pending_frame = None
                if frame.f_code.co_filename in targets and arg not in pure:
                    tok = footprint.c_call_token(arg)  # a C function may change what it was given
                    if tok is not None:
                        touched.add(tok)

        return profile

    def _call_hook(self, task: Task, trace_local: Any) -> Any:
        """Python frames entered: a switch point (RESUME); traced ones get `trace_local`."""
        targets, touched, wildcard, reached = self.targets, self.touched, footprint.WILDCARD, self.reached
        explorer_prefix = EXPLORER_DIR + os.sep

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
                    reached.add(filename)  # (the report names its module: a race in there is not explored)
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

        return trace_call

    def _opcode_hook(self, task: Task) -> Any:
        """Each opcode of a traced frame: switch points passed, and a choice point before a visible
        operation reached after one; each line (line mode, the narrative)."""
        opcode_mode, gil_mode, line_mode = (self.mode is SwitchMode.OPCODE, self.mode is SwitchMode.GIL,
                                            self.mode is SwitchMode.LINE)
        record, touched, wildcard = self.record, self.touched, footprint.WILDCARD
        cache, max_ops = self._info_cache, self.max_ops

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

        return trace_local

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

    # --- provided by the classes above (scheduling.Scheduling, runtime.Runtime) ---------------
    def _end(self, outcome: Outcome, message: str | None) -> None:
        raise NotImplementedError

    def choice(self, task: Task, frame: Any, what: str, gil_ok: bool, yielding: bool = False, guard: Any = None) -> None:
        raise NotImplementedError
