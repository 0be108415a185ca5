"""Owns presenting a diagnosis: the evidence table (rich), the load-sweep plot (PNG) and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from isolab.doctor.experiments import symptoms_by_kind
from isolab.doctor.symptoms import Symptom
from isolab.doctor.verdict import NO_SYMPTOM, UNEXERCISED, Findings, Verdict, to_json

_SHORT = {"prefix_cache_hits_tokens": "hit tokens", "evictions": "evictions", "preemptions": "preemptions",
          "audit_violations": "audit violations", "cached_tokens": "cached tokens"}


def print_report(f: Findings, v: Verdict) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    runs = Table(title=f"isolab doctor: {f.target}")
    for col in ("run", "content", "prefix cache", "symptomatic", "kinds", "engine counters"):
        runs.add_column(col)
    for r in [f.alone, *f.sweep, f.variant, *f.nocache]:
        kinds = ", ".join(f"{k} {n}" for k, n in symptoms_by_kind(r.symptoms).items()) or "-"
        stats = ", ".join(f"{_SHORT.get(k, k)} {n}" for k, n in r.stats.items() if n and k != "steps") or "-"
        runs.add_row(r.label, r.content, "on" if r.prefix_cache else "off", f"{r.num_symptomatic}/{r.num_items}", kinds, stats)
    console.print(runs)
    qs = Table(title="the four questions (seed, section 5.1)")
    for col in ("question", "answer", "evidence"):
        qs.add_column(col)
    for a in v.answers:
        qs.add_row(a.question, f"[bold]{a.answer}", a.evidence)
    console.print(qs)
    # up to 5 examples, each item once (the sweep's runs repeat the same items), named with its run
    seen: set[tuple[str, str]] = set()
    examples: list[tuple[str, Symptom]] = []
    for r in [f.alone, *f.sweep, f.variant, *f.nocache]:
        for s in r.symptoms:
            if (s.item_id, s.kind) not in seen and len(examples) < 5:
                seen.add((s.item_id, s.kind))
                examples.append((r.label, s))
    for label, s in examples:
        console.print(f"  e.g. {s.item_id} in {label} ({s.kind}): {s.detail}")
    for w in f.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    if f.numerics is not None:
        state = "batch-invariant" if f.batch_invariant else "[red]NOT batch-invariant[/]"
        console.print(f"numerics (the target's start-up check): {f.numerics}, {state}")
    colour = {NO_SYMPTOM: "green", UNEXERCISED: "yellow"}.get(v.verdict, "red")
    console.print(f"verdict: [bold {colour}]{v.verdict}[/]")


def write_json(f: Findings, v: Verdict, path: str | Path, extra: dict | None = None) -> None:
    data = to_json(f, v)
    data.update(extra or {})
    Path(path).write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def plot_sweep(f: Findings, path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    cs = [r.concurrency for r in f.sweep]
    ax.plot(cs, [100 * r.rate for r in f.sweep], "o-", color="#d00000", lw=3, ms=8, label="prefix cache on")  # type: ignore[arg-type]
    if f.nocache:
        ax.plot([r.concurrency for r in f.nocache], [100 * r.rate for r in f.nocache], "s--", color="#1f77b4", mfc="white",  # type: ignore[arg-type]
                lw=1.3, label="prefix cache off")
    ax.plot([f.variant.concurrency], [100 * f.variant.rate], "D", color="#7b2cbf", label="other content, same shapes")  # type: ignore[arg-type]
    ax.axhline(100 * f.alone.rate, color="grey", ls=":", label="each alone")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])  # type: ignore[arg-type]
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("symptomatic requests (%)")
    ax.set_ylim(-1, max(10.0, 100 * max([r.rate for r in [*f.sweep, *f.nocache, f.variant]] or [0]) * 1.2))
    ax.set_title(title or f.target, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
