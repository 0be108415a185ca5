"""Owns the probe's outputs: the terminal summary, report.json, and report.md with its PNG plots.

Reads a ProbeResult; never talks to a server. The JSON holds every record, so verdicts can be
recomputed later (isolab.probe.verdicts) without the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isolab.probe.catalogue import FAULT_VISIBILITY
from isolab.probe.runner import ProbeResult
from isolab.probe.verdicts import Status, Verdict

MARK = {Status.PASS: "PASS", Status.FAIL: "FAIL", Status.INCONCLUSIVE: "INCONCLUSIVE"}
COLOUR = {Status.PASS: "green", Status.FAIL: "red", Status.INCONCLUSIVE: "yellow"}


def to_json(result: ProbeResult) -> dict[str, Any]:
    return {
        "base_url": result.base_url, "model": result.model, "started": result.started, "seconds": result.seconds,
        "exit_code": result.exit_code, "notes": result.notes, "durations": result.durations,
        "settings": result.settings, "verdicts": [v.to_json() for v in result.verdicts],
        "records": [r.to_json() for r in result.records],
    }


def print_summary(result: ProbeResult, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"isolab probe: {result.base_url} ({result.model}), {len(result.records)} requests, {result.seconds:.0f} s")
    table.add_column("scenario")
    table.add_column("verdict")
    table.add_column("evidence", overflow="fold")
    for v in result.verdicts:
        # the checks the summary does not already say: those that did not pass, and opt-in ones (timing)
        optional = {c.get("name") for c in v.data.get("checks", []) if c.get("optional")}
        more = []
        for line in v.evidence:  # "[STATUS] check name: its summary"
            status, _, said = line.partition("] ")
            if said not in v.summary and (status != "[PASS" or said.split(":", 1)[0] in optional):
                more.append(line)
        lines = [v.summary] + more[:4]
        table.add_row(v.name, f"[{COLOUR[v.status]}]{MARK[v.status]}[/]", "\n".join(lines))
    console.print(table)
    for note in result.notes:
        console.print(f"  note: {note}")


def _comparisons(v: Verdict) -> list[dict[str, Any]]:
    out = []
    for check in v.data.get("checks", []):
        out += check.get("data", {}).get("comparisons", [])
    return out


def _timing(result: ProbeResult) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    names = {"timing-own": "tenant A: own cached prefix", "timing-other": "tenant B: prefix cached by A",
             "timing-miss": "tenant B: never cached"}
    for r in result.records:
        for tag, label in names.items():
            if tag in r.tags and r.ok and r.ttft_s is not None:
                groups.setdefault(label, []).append(r.ttft_s * 1e3)
    return groups


def write_plots(result: ProbeResult, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups = _timing(result)
    if groups:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, xs in groups.items():
            xs = sorted(xs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT per tenant (empirical CDF)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
        plt.close(fig)
        written.append("ttft.png")
    comps = [(v.name, c) for v in result.verdicts for c in _comparisons(v) if c.get("position") is not None]
    if comps:
        fig, ax = plt.subplots(figsize=(7, 4))
        for kind, colour in (("contamination", "tab:red"), ("drift", "tab:orange"), ("undecided", "tab:gray")):
            pts = [(c["position"], c["margin"] if c.get("margin") is not None else 0.0) for _, c in comps if c["kind"] == kind]
            if pts:
                ax.scatter([p for p, _ in pts], [m for _, m in pts], label=f"{kind} ({len(pts)})", color=colour, alpha=0.7)
        ax.axhline(result.settings["thresholds"]["margin"], color="k", lw=0.8, ls="--", label="margin threshold")
        ax.set_xlabel("first differing token")
        ax.set_ylabel("reference's margin there (nats; 0 = unknown)")
        ax.set_title("Where divergences start")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "divergence.png", dpi=110)
        plt.close(fig)
        written.append("divergence.png")
    return written


def markdown(result: ProbeResult, plots: list[str]) -> str:
    lines = [f"# Isolation probe report: {result.base_url}", "",
             f"Model `{result.model}`, started {result.started}, {len(result.records)} requests in {result.seconds:.1f} s. "
             f"Exit code {result.exit_code}.", "", "| scenario | verdict | summary | seconds |", "|---|---|---|---|"]
    for v in result.verdicts:
        lines.append(f"| {v.name} | **{MARK[v.status]}** | {v.summary} | {result.durations.get(v.name, '')} |")
    lines += ["", "## Evidence", ""]
    for v in result.verdicts:
        lines.append(f"### {v.name}: {MARK[v.status]}")
        for check in v.data.get("checks", []):
            lines.append(f"- **{check['status']}** {check['name']}: {check['summary']}"
                         + (" (opt-in)" if check.get("optional") else ""))
            lines += [f"  - {e}" for e in check["evidence"][:12]]
        lines.append("")
    lines += ["## Server capabilities", ""] + [f"- {n}" for n in result.notes] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    if "ttft.png" not in plots:
        lines += ["(No TTFT plot: the timing test is opt-in, run with `--timing`.)", ""]
    lines += ["## isolab's fault catalogue seen from outside", "",
              "| fault | scenario that catches it | how it shows, or why it is invisible |", "|---|---|---|"]
    for fault, (scenario, why) in FAULT_VISIBILITY.items():
        lines.append(f"| {fault} | {scenario or 'invisible from outside'} | {why} |")
    lines += ["", "Drift vs contamination: a greedy difference counts as contamination only where the reference run "
              f"preferred its own token by more than {result.settings['thresholds']['margin']} nats, or where another "
              "request's canary appears; near ties are reported as batch variance."]
    return "\n".join(lines) + "\n"


def write_report(result: ProbeResult, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(to_json(result), indent=1))
    plots = write_plots(result, out)
    (out / "report.md").write_text(markdown(result, plots))
    return out
