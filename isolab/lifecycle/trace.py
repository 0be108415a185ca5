"""Owns reading a block lifecycle trace (JSONL from `--trace`) into block lives, and checking it is complete.

Does not draw (draw.py). One record a line, written by isolab/engine/events.py:
    {"step": int, "event": kind, "block": int, "request": str|null, "scope": str|null, ...extra}

A life of a block, as the pool emits it (block_pool.py):

    allocated(writer) -> written* -> sealed? -> hit(reader)* / released(holder)* -> freed
                                                                \\-> (refs 0, sealed: kept for hits) -> evicted
    poisoned: audit mode filled the freed/evicted block with NaN;  violation: audit caught a read/write

Complete: every life ends in `freed` or `evicted`, or at the end of the trace it is still held
(refs > 0) or sealed and idle in the cache. A life whose holders all released it, unsealed and
never freed, or a block allocated again while held, means an event is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from isolab.engine.events import EVENT_KINDS
from isolab.errors import InvalidRequestError, is_whole

REQUIRED = ("step", "event", "block", "request", "scope")


@dataclass
class Hold:
    holder: str
    start: int  # step of allocated (the writer) or hit (a reader)
    end: int | None = None  # step of its release; None: still held at the end
    shared: bool = False  # a prefix-cache hit, not the writer's own allocation


@dataclass
class Life:
    block: int
    generation: int | None
    writer: str | None
    scope: str | None
    start: int
    end: int | None = None
    end_kind: str | None = None  # freed | evicted | None (open at the end)
    sealed_at: int | None = None
    refs: int = 1
    holds: list[Hold] = field(default_factory=list)
    idle_since: int | None = None  # refs fell to 0 while sealed: kept for hits

    @property
    def owner_label(self) -> str:
        return self.writer or "?"


@dataclass
class Trace:
    records: list[dict]
    lives: list[Life]
    marks: list[dict]  # poisoned and violation records
    last_step: int
    problems: list[str]

    @property
    def blocks(self) -> list[int]:
        return sorted({life.block for life in self.lives} | {m["block"] for m in self.marks})

    @property
    def violations(self) -> list[dict]:
        return [m for m in self.marks if m["event"] == "violation"]

    def open_lives(self) -> list[Life]:
        return [life for life in self.lives if life.end is None]


def read_records(path: str | Path, notes: list[str] | None = None) -> list[dict]:
    """The trace's events. A last line cut short (no newline: the writer died mid-line) is left out,
    with a sentence in `notes` where given; anything else that is not an event is an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the trace {path}: {exc.strerror}", field="trace") from None
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{path} is not UTF-8 text: is it a trace written by --trace?", field="trace") from None
    lines = text.splitlines()
    out: list[dict] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if n == len(lines) and not text.endswith("\n") and out:
                if notes is not None:
                    notes.append(f"line {n}, the last, is cut short (its writer stopped mid-line): left out")
                break
            raise InvalidRequestError(f"{path} line {n} is not JSON: is it a trace written by --trace?", field="trace") from None
        if not _is_event(rec):
            raise InvalidRequestError(
                f"{path} line {n} is not a block event (needs {', '.join(REQUIRED)}, a known event, integer step "
                "and block, text or null request and scope)", field="trace"
            )
        out.append(rec)
    return out


def _is_event(rec: object) -> bool:
    """The shape build() relies on: integer step, block (and refs), a known event, text-or-null names."""
    return (isinstance(rec, dict) and all(k in rec for k in REQUIRED) and isinstance(rec["event"], str)
            and rec["event"] in EVENT_KINDS and is_whole(rec["step"]) and is_whole(rec["block"])
            and all(rec[k] is None or isinstance(rec[k], str) for k in ("request", "scope"))
            and ("refs" not in rec or is_whole(rec["refs"])))


def build(records: list[dict]) -> Trace:
    """Replay the events into lives; inconsistencies become `problems` (never an exception)."""
    current: dict[int, Life] = {}
    lives: list[Life] = []
    marks: list[dict] = []
    problems: list[str] = []
    last = 0
    for rec in records:
        step, kind, b, who = rec["step"], rec["event"], rec["block"], rec["request"]
        if step < last:
            problems.append(f"step goes back from {last} to {step} at block {b} ({kind})")
        last = max(last, step)
        life = current.get(b)
        if kind == "allocated":
            if life is not None:
                problems.append(f"step {step}: block {b} allocated to {who} while its life by {life.writer} never ended "
                                f"(refs {life.refs})")
                life.end, life.end_kind = step, None
            life = Life(b, rec.get("generation"), who, rec["scope"], step)
            life.holds.append(Hold(who, step))
            current[b] = life
            lives.append(life)
        elif kind in ("poisoned", "violation"):
            marks.append(rec)
        elif life is None:
            problems.append(f"step {step}: {kind} on block {b}, which no allocated event opened")
        elif kind == "sealed":
            life.sealed_at = step
        elif kind == "hit":
            life.refs += 1
            life.idle_since = None
            life.holds.append(Hold(who, step, shared=True))
        elif kind == "released":
            life.refs -= 1
            if "refs" in rec and rec["refs"] != life.refs:
                problems.append(f"step {step}: block {b} has {rec['refs']} holders by the trace, {life.refs} by the replay")
                life.refs = rec["refs"]
            hold = next((h for h in life.holds if h.holder == who and h.end is None), None)
            if hold is None:
                problems.append(f"step {step}: {who} released block {b} without holding it")
            else:
                hold.end = step
            if life.refs == 0:
                life.idle_since = step
        elif kind in ("freed", "evicted"):
            life.end, life.end_kind = step, kind
            del current[b]
    for life in current.values():
        if life.refs == 0 and life.sealed_at is None:
            problems.append(f"block {b_of(life)}: every holder released it, unsealed, but it was never freed")
    return Trace(records, lives, marks, last, problems)


def b_of(life: Life) -> str:
    return f"{life.block} (life of {life.writer}, from step {life.start})"


def load(path: str | Path) -> Trace:
    notes: list[str] = []
    trace = build(read_records(path, notes))
    trace.problems[:0] = notes
    return trace


def summary_lines(trace: Trace) -> list[str]:
    """What `isolab lifecycle` and the demo print of a trace: its lives, each violation, what is missing."""
    c = completeness(trace)
    lines = [f"{c['lives']} block lives over {trace.last_step} steps: {c['ended']} ended (freed or evicted), "
             f"{c['still_held']} still held, {c['cached_idle']} cached and idle; {c['violations']} audit violations"]
    for v in trace.violations:
        if v.get("access") == "write":  # the engine names the access (audit.py); older traces do not
            lines.append(f"  violation at step {v['step']}: block {v['block']} written by {v['request']}, "
                         f"last written by {v.get('writer')} (a write it may not make)")
        else:
            lines.append(f"  violation at step {v['step']}: block {v['block']} read by {v['request']}, "
                         f"written by {v.get('writer')}")
    lines += [f"  incomplete: {problem}" for problem in c["problems"]]
    return lines


def completeness(trace: Trace) -> dict:
    """Counts for the report: every life ended, still held, or cached and idle; and any problems."""
    ended = sum(1 for life in trace.lives if life.end_kind in ("freed", "evicted"))
    held = sum(1 for life in trace.open_lives() if life.refs > 0)
    cached = sum(1 for life in trace.open_lives() if life.refs == 0 and life.sealed_at is not None)
    return {"lives": len(trace.lives), "ended": ended, "still_held": held, "cached_idle": cached,
            "violations": len(trace.violations), "problems": list(trace.problems),
            "complete": not trace.problems and ended + held + cached == len(trace.lives)}
