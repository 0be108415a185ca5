"""Owns the narrative of an execution: recording it step by step while the threads run (the
`Recorder` mixin of runtime.Runtime) and telling it afterwards (`render`); does not know how
threads are chosen or traced.

One line per source line reached, with the thread, the place, the shared value as the line
starts, and where the baton moved. A line cut by a switch appears twice: where it started, and
"(resumed)" where its thread picks it up again; a thread that raised says so instead of
"returns"."""

from __future__ import annotations

import linecache
import os
from dataclasses import replace
from typing import Any

from isolab.race.explorer.task import Task
from isolab.race.explorer.types import Execution, Step, short_path


class Recorder:
    """Records the narrative when `record` is set. The attributes are owned by runtime.Runtime."""

    record: bool
    steps: list[Step]

    def _init_recorder(self) -> None:
        self._seen_in_run: dict[int, dict[str, int]] = {}  # thread -> location -> step index

    def _shared(self) -> str:
        """The watched shared value now (runtime.Runtime runs the scenario's watch)."""
        raise NotImplementedError

    def _note_line(self, task: Task, frame: Any, resumed: bool = False) -> None:
        location = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        shared = self._shared()
        seen = self._seen_in_run.setdefault(task.index, {})
        if location in seen and not resumed:
            i = seen[location]
            s = self.steps[i] if i < len(self.steps) else None
            if s is not None and s.shared == shared and s.thread == task.index and not s.switch:
                self.steps[i] = replace(s, repeats=s.repeats + 1)
                return
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        seen[location] = len(self.steps)
        self.steps.append(Step(thread=task.index, location=location, source=source, shared=shared, resumed=resumed))

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
                    self.steps[i] = replace(s, switch=why)
                break


def render(execution: Execution, names: tuple[str, ...], value_label: str = "shared") -> str:
    rows = []
    for i, s in enumerate(execution.steps, start=1):
        where = f"{os.path.basename(s.location.rsplit(':', 1)[0])}:{s.location.rsplit(':', 1)[1]}"
        source = ("(resumed) " if s.resumed else "") + s.source + (f"   (x{s.repeats})" if s.repeats > 1 else "")
        rows.append((str(i), names[s.thread], where, s.shared, source, s.switch))
    if not rows:
        return "(no steps recorded)"
    widths = [max(len(r[k]) for r in rows + [("#", "thread", "where", value_label, "", "")]) for k in range(4)]
    head = f"{'#':>{widths[0]}}  {'thread':<{widths[1]}}  {'where':<{widths[2]}}  {value_label:<{widths[3]}}  source"
    lines = [head]
    for r in rows:
        lines.append(f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:<{widths[3]}}  {r[4]}")
        if r[5]:
            lines.append(f"{'':>{widths[0]}}  {'':<{widths[1]}}  -- {_why(r[5])}")
    lines.append(f"=> {execution.verdict}")
    return "\n".join(lines)


def _why(switch: str) -> str:
    if switch.endswith("thread done") or switch.startswith("reached its first"):
        return switch
    return f"{switch}: the baton moves"
