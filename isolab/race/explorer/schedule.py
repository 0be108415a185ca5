"""Owns the schedule file: a losing schedule as plain text lines a person can read and edit,
and the strict replay that follows it and names the first step that diverges; does not search or
shrink (search.py, shrink.py).

    # isolab race schedule v1
    scenario: passcode:buggy
    target: passcode:buggy
    switch: gil
    outcome: failed: false accept: the wrong passcode was accepted
    source: isolab/race/checkers.py sha256=1f0c9a2b7d3e
    step 0: <none> at <start>#1 [start] -> right
    step 1: right at isolab/race/checkers.py:38#1 [LOAD_ATTR input_buffer] -> wrong preempt

A step is keyed by where it is taken (thread, file:line, occurrence of that line's choice points
for that thread), never by a raw counter, so an edit elsewhere in the file shows up as the
first step whose key no longer matches, next to the changed source hash.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from isolab.errors import InvalidRequestError
from isolab.race.explorer.runtime import run_once
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.task import RunLimits
from isolab.race.explorer.types import ROOT, Execution, ExitCode, PendingPoint, SwitchMode, short_path

HEADER = "# isolab race schedule v1"
_STEP = re.compile(r"^step (\d+): (\S+) at (\S+)#(\d+) \[(.*)\] -> (\S+)( preempt)?$")


@dataclass(frozen=True)
class ScheduleStep:
    thread: str  # who stood at the choice point ("<none>" at the start)
    location: str
    occurrence: int
    what: str
    chosen: str  # who ran next
    preempt: bool

    def key(self) -> tuple[str, str, int]:
        return (self.thread, self.location, self.occurrence)


@dataclass(frozen=True)
class Schedule:
    scenario: str
    switch: str
    outcome: str
    sources: dict[str, str]  # short path -> sha256 prefix, as saved
    steps: tuple[ScheduleStep, ...]
    target: str = ""  # the TARGET string to load it again (a file target's absolute path)
    trace_modules: tuple[str, ...] = ()  # traced beyond the default when it was found (--trace-module)

    def render(self) -> str:
        lines = [HEADER, f"scenario: {self.scenario}"] + ([f"target: {self.target}"] if self.target else [])
        lines += [f"switch: {self.switch}", f"outcome: {self.outcome}"]
        lines += [f"trace: {','.join(self.trace_modules)}"] if self.trace_modules else []
        lines += [f"source: {path} sha256={digest}" for path, digest in sorted(self.sources.items())]
        for i, s in enumerate(self.steps):
            lines.append(f"step {i}: {s.thread} at {s.location}#{s.occurrence} [{s.what}] -> {s.chosen}"
                         + (" preempt" if s.preempt else ""))
        return "\n".join(lines) + "\n"


def source_hashes(scenario: Scenario) -> dict[str, str]:
    return {short_path(f): _digest(f) for f in sorted(scenario.target_files())}


def _digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    except OSError:
        return "missing"


def from_execution(scenario: Scenario, mode: SwitchMode, execution: Execution) -> Schedule:
    names = scenario.names
    steps = tuple(
        ScheduleStep(
            thread=names[c.point.current] if c.point.current is not None else "<none>",
            location=c.point.location, occurrence=c.point.occurrence, what=c.point.what,
            chosen=names[c.chosen], preempt=c.preemptive,
        )
        for c in execution.points
    )
    return Schedule(scenario=scenario.name, switch=mode.value, outcome=execution.verdict,
                    sources=source_hashes(scenario), steps=steps,
                    target=absolute_target(scenario.target or scenario.name), trace_modules=scenario.trace_modules)


def absolute_target(target: str) -> str:
    """A file target with its path made absolute, so the schedule replays from anywhere."""
    head, sep, attr = target.rpartition(":")
    if sep and head.endswith(".py"):
        return f"{Path(head).resolve()}:{attr}"
    return target


def parse(text: str) -> Schedule:
    lines = [ln.rstrip("\n") for ln in text.splitlines()]
    if not lines or lines[0].strip() != HEADER:
        raise InvalidRequestError("not an isolab schedule file (first line must be the v1 header)")
    fields: dict[str, str] = {}
    sources: dict[str, str] = {}
    steps: list[ScheduleStep] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("step "):
            m = _STEP.match(line)
            if m is None or int(m.group(1)) != len(steps):
                raise InvalidRequestError(f"schedule line {number} is not a step in order: {line!r}")
            steps.append(ScheduleStep(thread=m.group(2), location=m.group(3), occurrence=int(m.group(4)),
                                      what=m.group(5), chosen=m.group(6), preempt=bool(m.group(7))))
        elif line.startswith("source: "):
            path, _, digest = line[len("source: "):].rpartition(" sha256=")
            sources[path] = digest
        else:
            key, sep, value = line.partition(": ")
            if not sep:
                raise InvalidRequestError(f"schedule line {number} is not 'key: value': {line!r}")
            fields[key] = value
    for key in ("scenario", "switch"):
        if key not in fields:
            raise InvalidRequestError(f"schedule file has no '{key}:' line")
    if fields["switch"] not in {m.value for m in SwitchMode}:
        raise InvalidRequestError(f"schedule file's switch is {fields['switch']!r}; it must be one of "
                                  f"{', '.join(m.value for m in SwitchMode)}")
    trace = tuple(m.strip() for m in fields.get("trace", "").split(",") if m.strip())
    return Schedule(scenario=fields["scenario"], switch=fields["switch"], outcome=fields.get("outcome", ""),
                    sources=sources, steps=tuple(steps), target=fields.get("target", ""), trace_modules=trace)


def save(path: Path, schedule: Schedule) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(schedule.render())


def load(path: Path) -> Schedule:
    try:
        return parse(path.read_text())
    except OSError as exc:
        raise InvalidRequestError(f"cannot read schedule {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{path} is not an isolab schedule file (not UTF-8 text)") from None


class StrictReplayChooser:
    """Takes step i's choice only if step i's key matches where the run actually stands."""

    def __init__(self, schedule: Schedule, names: tuple[str, ...]) -> None:
        self.steps = schedule.steps
        self.names = names
        self.divergence: str | None = None

    def choose(self, point: PendingPoint) -> int:
        actual = (self.names[point.current] if point.current is not None else "<none>", point.location, point.occurrence)
        if self.divergence is None:
            if point.index >= len(self.steps):
                self.divergence = f"step {point.index}: the run goes on at {_key(actual)}, the schedule has ended"
            else:
                step = self.steps[point.index]
                chosen = self.names.index(step.chosen) if step.chosen in self.names else None
                if step.key() != actual or chosen not in point.enabled:
                    self.divergence = f"step {point.index}: schedule expects {_key(step.key())}, the run is at {_key(actual)}"
                else:
                    return chosen
        return point.default


def _key(key: tuple[str, str, int]) -> str:
    return f"{key[0]} at {key[1]}#{key[2]}"


@dataclass(frozen=True)
class ReplayResult:
    runs: int
    reproduced: int  # runs that ended with the saved outcome
    divergence: str | None  # first diverging step of the first run that diverged
    changed_sources: tuple[str, ...]  # files whose hash differs from the saved one
    last: Execution  # the first run that failed, else the last run (what the narrative shows)
    failed: int = 0  # runs that ended in a failure (the saved one or another)
    inconclusive: int = 0  # runs a limit stopped, or the model could not run

    @property
    def exit_code(self) -> ExitCode:
        """BUG if any run failed; else INCONCLUSIVE if any run was, or the schedule could not be followed
        (a divergence: such a replay shows nothing, the fix and a stale schedule alike); else HOLDS."""
        if self.failed:
            return ExitCode.BUG
        if self.inconclusive or self.divergence:
            return ExitCode.INCONCLUSIVE
        return ExitCode.HOLDS


def replay(scenario: Scenario, schedule: Schedule, times: int = 1, limits: RunLimits | None = None) -> ReplayResult:
    if scenario.name != schedule.scenario:
        raise InvalidRequestError(f"schedule is for {schedule.scenario}, not {scenario.name}")
    mode = SwitchMode(schedule.switch)  # (parse checked it)
    for i, step in enumerate(schedule.steps):  # a thread no run has is a bad file, not a divergence (exit 3)
        for who, may_be_none in ((step.thread, True), (step.chosen, False)):  # (step 0 runs from no thread)
            if who not in scenario.names and not (may_be_none and who == "<none>"):
                raise InvalidRequestError(f"schedule step {i} names thread {who}, which {scenario.name} does not "
                                          f"have (its threads: {', '.join(scenario.names)})")
    now = source_hashes(scenario)
    changed = tuple(p for p, d in schedule.sources.items() if now.get(p) != d)
    reproduced, failed, inconclusive, divergence, last, first_failed = 0, 0, 0, None, None, None
    for _ in range(times):
        chooser = StrictReplayChooser(schedule, scenario.names)
        last = run_once(scenario, chooser, mode, record=True, limits=limits)
        if chooser.divergence is None and len(last.points) < len(schedule.steps):
            chooser.divergence = f"step {len(last.points)}: the run ended, the schedule goes on"
        if chooser.divergence is None and last.verdict == schedule.outcome:
            reproduced += 1
        failed += bool(last.failed)
        first_failed = first_failed or (last if last.failed else None)
        inconclusive += bool(last.outcome.is_inconclusive)
        divergence = divergence or chooser.divergence
    assert last is not None
    return ReplayResult(times, reproduced, divergence, changed, first_failed or last, failed, inconclusive)


__all__ = ["ROOT", "Schedule", "ScheduleStep", "absolute_target", "load", "parse", "replay", "save", "from_execution"]
