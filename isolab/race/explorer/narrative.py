"""Owns how a recorded execution is told: one line per source line reached, with the thread,
the place, the shared value as the line starts, and where the baton moved. A line cut by a
switch appears twice: where it started, and "(resumed)" where its thread picks it up again; a
thread that raised says so instead of "returns"."""

from __future__ import annotations

import os

from isolab.race.explorer.types import Execution


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
