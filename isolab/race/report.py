"""Owns how stress results are shown: the graded table, the outcome histogram, JSON and the plot.

It reads `RunResult`s and never runs anything itself.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from isolab.race.checkers import VARIANTS
from isolab.race.stress import RunResult, environment, grade

OUTCOMES = (  # (label, RunResult field, expectation), in the order jcstress would list them
    ("right -> accept", "true_accepts", "ACCEPTABLE"),
    ("wrong -> reject", "true_rejects", "ACCEPTABLE"),
    ("wrong -> accept", "false_accepts", "FORBIDDEN"),
    ("right -> reject", "false_rejects", "FORBIDDEN"),
)


def _groups(results: Sequence[RunResult]) -> dict[tuple[str, int], list[RunResult]]:
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.variant, r.threads), []).append(r)
    return groups


def table(results: Sequence[RunResult]) -> str:
    """One row per (variant, threads): the counts of every repeat, the rate and the QPS."""
    header = f"{'variant':<20} {'thr':>3} {'false accepts':<18} {'false rejects':<18} {'FA/100k':>8} {'QPS':>9}  grade"
    lines = [header, "-" * len(header)]
    for (name, threads), runs in _groups(results).items():
        fa = ",".join(str(r.false_accepts) for r in runs)
        fr = ",".join(str(r.false_rejects) for r in runs)
        rate = statistics.mean(r.false_accepts_per_100k for r in runs)
        qps = statistics.mean(r.qps for r in runs)
        grades = {grade(VARIANTS[name], r) for r in runs}
        verdict = "OK" if grades == {"OK"} else sorted(grades - {"OK"})[0]
        mark = "  <-- FORBIDDEN" if verdict.startswith("FAILED") else ""
        lines.append(f"{name:<20} {threads:>3} {fa:<18} {fr:<18} {rate:>8.1f} {qps:>9.0f}  {verdict}{mark}")
    return "\n".join(lines)


def histogram(results: Sequence[RunResult]) -> str:
    """jcstress-style outcome counts per variant, summed over every run."""
    lines: list[str] = []
    by_variant: dict[str, list[RunResult]] = {}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    for name, runs in by_variant.items():
        variant = VARIANTS[name]
        lines.append(f"{name}: {variant.summary}{'  [racy by design]' if variant.racy else ''}")
        for label, field, expectation in OUTCOMES:
            count = sum(getattr(r, field) for r in runs)
            flag = "  <-- seen" if expectation == "FORBIDDEN" and count else ""
            lines.append(f"  {label:<16} {count:>10}  {expectation}{flag}")
    return "\n".join(lines)


def write_json(path: Path, results: Sequence[RunResult], command: str) -> None:
    payload = {
        "command": command,
        "environment": environment(),
        "runs": [r.to_json() for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot(path: Path, results: Sequence[RunResult], title: str) -> Path:
    """False accepts per 100k requests against threads, one line per variant (min..max bars); the path
    written (matplotlib adds .png to a name without a suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_variant: dict[str, dict[int, list[float]]] = {}
    for r in results:
        by_variant.setdefault(r.variant, {}).setdefault(r.threads, []).append(r.false_accepts_per_100k)
    for name, per_threads in by_variant.items():
        xs = sorted(per_threads)
        means = [statistics.mean(per_threads[x]) for x in xs]
        lows = [m - min(per_threads[x]) for m, x in zip(means, xs, strict=True)]
        highs = [max(per_threads[x]) - m for m, x in zip(means, xs, strict=True)]
        ax.errorbar(xs, means, yerr=[lows, highs], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r.threads for r in results}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("threads (half send the right passcode)")
    ax.set_ylabel("false accepts per 100,000 requests")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.suffix:
        path = path.with_suffix(".png")  # (what savefig writes; "wrote noext" named a file that is not there)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
