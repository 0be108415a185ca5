"""Schedules: plain text that round-trips, replays N of N, and names the first divergence when
the code changed. Never skipped."""

from __future__ import annotations

import textwrap
from pathlib import Path

from isolab.race.explorer import SwitchMode, load
from isolab.race.explorer.api import explore
from isolab.race.explorer.schedule import load as load_schedule
from isolab.race.explorer.schedule import parse, replay, save
from isolab.race.scenarios import passcode
from isolab.race.stress import RIGHT, WRONG


def test_replay_round_trip_reproduces_every_time(tmp_path: Path) -> None:
    scenario = passcode("buggy")
    report = explore(scenario, SwitchMode.OPCODE, bound=2)
    assert report.finding is not None
    path = tmp_path / "buggy.schedule"
    save(path, report.finding.schedule)
    schedule = load_schedule(path)
    assert schedule == report.finding.schedule
    assert parse(schedule.render()) == schedule
    result = replay(load("passcode:buggy"), schedule, times=10)
    assert (result.reproduced, result.runs) == (10, 10)
    assert result.divergence is None and result.changed_sources == ()
    text = path.read_text()
    assert "-> right" in text and RIGHT not in text and WRONG not in text  # labels, never the passcode


def test_schedule_file_reads_as_text(tmp_path: Path) -> None:
    report = explore(passcode("buggy"), SwitchMode.GIL, bound=1)
    assert report.finding is not None
    text = report.finding.schedule.render()
    assert text.startswith("# isolab race schedule v1\nscenario: passcode:buggy\ntarget: passcode:buggy\nswitch: gil\n")
    assert " preempt\n" in text and "isolab/race/checkers.py:" in text


TARGET = """
    import threading
    from isolab.race.explorer import Scenario

    class Box:
        def __init__(self):
            self.value = 0

    def bump(box):
        {extra}v = box.value
        threading.Event().set()
        box.value = v + 1

    def scenario():
        return Scenario("box", Box, (bump, bump), lambda b, r: None if b.value == 2 else "lost update")
"""


def test_replay_after_an_edit_reports_the_first_divergent_step(tmp_path: Path) -> None:
    target = tmp_path / "box.py"
    target.write_text(textwrap.dedent(TARGET.format(extra="")))
    scenario = load(f"{target}:scenario")
    report = explore(scenario, SwitchMode.GIL, bound=1)
    assert report.finding is not None
    schedule = report.finding.schedule
    assert replay(scenario, schedule).reproduced == 1
    target.write_text(textwrap.dedent(TARGET.format(extra="box.value += 0\n        ")))
    edited = load(f"{target}:scenario")
    result = replay(edited, schedule)
    assert result.changed_sources == (str(target),) or result.changed_sources[0].endswith("box.py")
    assert result.divergence is not None and result.divergence.startswith("step ")
