"""Schedules: plain text that round-trips, replays N of N, and names the first divergence when
the code changed. Never skipped."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from isolab.cli import main
from isolab.race.explorer import ExitCode, Scenario, SwitchMode, load, narrative
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


@pytest.mark.parametrize("fixture", ["deadlock", "lost_wakeup"])
def test_deadlock_replays_reproduce_every_time(fixture: str, tmp_path: Path, capsys) -> None:
    saved = tmp_path / f"{fixture}.schedule"
    assert main(["race", "explore", f"fixtures:{fixture}", "--quiet", "--save", str(saved)]) == ExitCode.BUG
    outcome = next(line for line in saved.read_text().splitlines() if line.startswith("outcome: "))
    assert outcome.startswith("outcome: deadlock: ") and "#" not in outcome and " s." in outcome
    capsys.readouterr()
    assert main(["race", "explore", "--replay", str(saved), "--times", "5"]) == ExitCode.BUG
    assert "reproduced 5 of 5" in capsys.readouterr().out


def test_replay_hint_after_save_works_for_a_file_target_from_another_folder(tmp_path: Path, monkeypatch,
                                                                            capsys) -> None:
    target = tmp_path / "box.py"
    target.write_text(textwrap.dedent(TARGET.format(extra="")))
    saved = tmp_path / "box.schedule"
    monkeypatch.chdir(tmp_path)
    assert main(["race", "explore", "box.py:scenario", "--quiet", "--switch", "gil", "--save", str(saved)]) == 1
    hint = capsys.readouterr().out.rsplit("replay: ", 1)[1].strip()
    assert hint == f"isolab race explore --replay {saved}"
    assert f"target: {target}:scenario" in saved.read_text()
    monkeypatch.chdir(Path(__file__).parent)
    assert main(hint.split()[1:] + ["--times", "3"]) == ExitCode.BUG
    assert "reproduced 3 of 3" in capsys.readouterr().out


def test_narrative_shows_the_resumed_half_of_a_cut_line_and_a_raise() -> None:
    report = explore(passcode("buggy"), SwitchMode.GIL, bound=1)
    assert report.finding is not None
    text = narrative.render(report.finding.execution, passcode("buggy").names)
    cut = [line for line in text.splitlines() if "self.result = (self.input_buffer == self.correct)" in line]
    resumed = [line for line in cut if "(resumed)" in line]
    assert len(cut) == 3 and len(resumed) == 1  # wrong's first half, right's whole line, wrong's second half
    assert resumed[0].split()[1] == "wrong" and "input_buffer=right" in resumed[0]
    raising = Scenario("raise", lambda: None, (lambda s: 1 // 0, lambda s: None), lambda s, r: None)
    failed = explore(raising, SwitchMode.GIL, bound=0)
    assert failed.finding is not None
    assert "-- raised ZeroDivisionError: integer division or modulo by zero; thread done" in narrative.render(
        failed.finding.execution, raising.names)


FIXED = TARGET.replace("{extra}v = box.value\n        threading.Event().set()\n        box.value = v + 1",
                       "with LOCK:\n            v = box.value\n            threading.Event().set()\n            box.value = v + 1"
                       ).replace("class Box:", "LOCK = threading.Lock()\n\n    class Box:")


def test_a_replay_whose_schedule_no_longer_applies_is_inconclusive(tmp_path: Path, capsys) -> None:
    """The bug fixed (a lock), the saved schedule cannot be followed: no run fails, and none shows
    anything about the fix either, so the replay exits 3 and says to search again (it exited 0, the
    HOLDS code, by its last run alone: a CI gate could not tell a fix from a stale schedule). A
    schedule file whose switch line was edited to nonsense is one sentence, exit 2 (a traceback)."""
    target = tmp_path / "box.py"
    target.write_text(textwrap.dedent(TARGET.format(extra="")))
    saved = tmp_path / "box.schedule"
    assert main(["race", "explore", f"{target}:scenario", "--quiet", "--switch", "gil", "--save", str(saved)]) == 1
    target.write_text(textwrap.dedent(FIXED))
    capsys.readouterr()
    assert main(["race", "explore", "--replay", str(saved), "--times", "3"]) == ExitCode.INCONCLUSIVE
    out = capsys.readouterr().out
    assert "reproduced 0 of 3" in out and "first divergence: step" in out and "no longer applies" in out
    assert main(["race", "explore", f"{target}:scenario", "--quiet", "--switch", "gil"]) == ExitCode.HOLDS
    bad = tmp_path / "bad.schedule"
    bad.write_text(saved.read_text().replace("switch: gil", "switch: foo"))
    capsys.readouterr()
    assert main(["race", "explore", "--replay", str(bad)]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.startswith("isolab: error: ") and "switch is 'foo'" in err and err.count("\n") == 1, err


def test_a_replay_refuses_the_flags_of_a_search(tmp_path: Path, capsys) -> None:
    """--switch, --strategy, --save and the other search flags were ignored without a word beside
    --replay (its schedule fixes the switch mode and every step): one sentence, exit 2. A search that
    finds nothing says it saved nothing."""
    saved = tmp_path / "b.schedule"
    assert main(["race", "explore", "passcode:buggy", "--quiet", "--save", str(saved)]) == ExitCode.BUG
    for flag in (["--switch", "gil"], ["--strategy", "pct"], ["--save", str(tmp_path / "x")], ["--bound", "3"],
                 ["--no-shrink"]):
        capsys.readouterr()
        assert main(["race", "explore", "--replay", str(saved), *flag]) == ExitCode.USAGE
        err = capsys.readouterr().err
        assert f"{flag[0]} belongs to a search" in err and err.count("\n") == 1, err
    assert main(["race", "explore", "passcode:lock_local", "--quiet", "--save", str(tmp_path / "none")]) == 0
    assert "nothing saved" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_the_schedule_records_the_modules_traced_beyond_the_default(tmp_path: Path) -> None:
    """A schedule found with --trace-module diverged on a replay without it (and a replay that cannot
    follow its schedule now exits 3): the file names them and the replay traces them again."""
    scenario = load("passcode:buggy", ["isolab.race.fixtures"])
    report = explore(scenario, SwitchMode.GIL, bound=1)
    assert report.finding is not None
    schedule = report.finding.schedule
    assert "isolab.race.fixtures" in schedule.trace_modules
    text = schedule.render()
    assert "\ntrace: " in text and parse(text).trace_modules == schedule.trace_modules
    saved = tmp_path / "t.schedule"
    save(saved, schedule)
    assert main(["race", "explore", "--replay", str(saved), "--times", "2"]) == ExitCode.BUG


def test_a_schedule_naming_a_thread_the_scenario_lacks_is_a_bad_file(tmp_path: Path, capsys) -> None:
    """A step edited to `-> T99` diverged at once, exit 3, with a message naming two identical positions
    ('schedule expects T0 at x#2, the run is at T0 at x#2'): it is one sentence, exit 2, naming T99."""
    saved = tmp_path / "lost.schedule"
    assert main(["race", "explore", "fixtures:lost_update", "--quiet", "--save", str(saved)]) == ExitCode.BUG
    bad = tmp_path / "bad.schedule"
    text = saved.read_text()
    assert "-> T1" in text
    bad.write_text(text.replace("-> T1", "-> T99", 1))
    capsys.readouterr()
    assert main(["race", "explore", "--replay", str(bad)]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names thread T99" in err and "T0, T1" in err, err
