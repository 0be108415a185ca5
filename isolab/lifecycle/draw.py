"""Owns drawing a lifecycle trace: a PNG (matplotlib) or a standalone HTML page (the PNG + an event table).

Does not parse (trace.py). The picture (claim C16: allocation, writing, reuse and recycling, with
the owner at every step):

    x = engine step, one row per block id
    solid bar         the writer holds the block (colour = the writing request)
    hatched band      another request holds it through a prefix-cache hit (colour = the reader)
    thin grey bar     sealed, no holder: kept in the cache for hits until evicted
    small square      sealed: full and immutable from this step on
    |  freed   v  evicted (orange)   .  poisoned (purple)   X  audit violation (red, "reader <- writer")
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from isolab.lifecycle.trace import Life, Trace

FREED, EVICTED, POISON, VIOLATION, IDLE = "black", "#e67e00", "#7b2cbf", "#d00000", "#b0b0b0"


def _colours(trace: Trace) -> dict[str, tuple]:
    import matplotlib

    names: list[str] = []
    for life in trace.lives:
        for h in life.holds:
            if h.holder not in names:
                names.append(h.holder)
    cmap = matplotlib.colormaps["tab20"]
    return {n: cmap(i % 20) for i, n in enumerate(names)}


def _idle_gaps(life: Life, end: int) -> list[tuple[int, int]]:
    """(start, width) spans where a sealed life had no holder: kept only for prefix-cache hits."""
    stop = life.end if life.end is not None else end
    spans = sorted((h.start, h.end if h.end is not None else end) for h in life.holds)
    gaps, t = [], life.start
    for a, b in spans:
        if a > t:
            gaps.append((t, a - t))
        t = max(t, b)
    if stop > t:
        gaps.append((t, stop - t))
    return gaps


def figure(trace: Trace, title: str = ""):  # noqa: ANN201 - a matplotlib Figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    blocks = trace.blocks
    row = {b: i for i, b in enumerate(blocks)}
    colours = _colours(trace)
    end = trace.last_step + 1
    fig, ax = plt.subplots(figsize=(min(4 + 0.16 * end, 22), min(1.6 + 0.32 * len(blocks), 18)))
    for life in trace.lives:
        y = row[life.block]
        for h in life.holds:
            span = (h.start, max((h.end if h.end is not None else end) - h.start, 0.6))
            c = colours[h.holder]
            if h.shared:
                ax.broken_barh([span], (y - 0.05, 0.42), facecolors=[(*c[:3], 0.55)], edgecolor=c, hatch="////", linewidth=0.6)
            else:
                ax.broken_barh([span], (y - 0.38, 0.76), facecolors=[c], edgecolor="white", linewidth=0.4)
        if life.sealed_at is not None:
            for gap in _idle_gaps(life, end):
                ax.broken_barh([gap], (y - 0.08, 0.16), facecolors=[IDLE])
        if life.sealed_at is not None:
            ax.plot([life.sealed_at + 0.5], [y - 0.25], marker="s", ms=2.5, color="white", mec="black", mew=0.4, ls="")
        if life.end_kind == "freed":
            ax.plot([life.end], [y], marker="|", ms=11, mew=1.6, color=FREED, ls="")  # type: ignore[arg-type]
        elif life.end_kind == "evicted":
            ax.plot([life.end], [y], marker="v", ms=7, color=EVICTED, mec="black", mew=0.4, ls="")  # type: ignore[arg-type]
    seen: dict[tuple[int, int], int] = {}
    for m in trace.marks:
        y = row[m["block"]]
        if m["event"] == "poisoned":
            ax.plot([m["step"] + 0.15], [y + 0.3], marker="o", ms=3, color=POISON, ls="")
        else:
            ax.plot([m["step"]], [y], marker="X", ms=14, color=VIOLATION, mec="white", mew=0.8, ls="", zorder=5)
            k = seen[(m["step"], m["block"])] = seen.get((m["step"], m["block"]), -1) + 1  # stack labels on one spot
            who, writer = m["request"], m.get("writer") or "nobody"
            label = f"{who} writes it while shared" if who == writer else f"{who} \u2190 {writer}"  # reader <- writer
            left = m["step"] > 0.6 * end  # keep the label inside the axes
            ax.annotate(label, (m["step"], y), xytext=(-12 if left else 10, 8 - 15 * k), ha="right" if left else "left",
                        textcoords="offset points", color=VIOLATION, fontsize=9, fontweight="bold",
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=VIOLATION, lw=0.8), zorder=6)
    ax.set_yticks(range(len(blocks)), [str(b) for b in blocks], fontsize=7)
    ax.set_ylim(-0.7, len(blocks) - 0.3)
    ax.invert_yaxis()
    ax.set_xlim(0, end + 1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("block id")
    ax.grid(axis="x", alpha=0.25)
    ax.set_title(title or f"KV block lifecycle: {len(trace.lives)} block lives, {len(trace.violations)} audit violations", fontsize=9, loc="left")
    owners = [Patch(facecolor=c, label=n) for n, c in list(colours.items())[:24]]
    keys = [
        Patch(facecolor="white", edgecolor="black", hatch="////", label="shared (cache hit)"),
        Patch(facecolor=IDLE, label="cached, no holder"),
        plt.Line2D([], [], marker="s", ms=3, color="white", mec="black", mew=0.5, ls="", label="sealed (full, read-only)"),
        plt.Line2D([], [], marker="|", ms=10, mew=1.6, color=FREED, ls="", label="freed"),
        plt.Line2D([], [], marker="v", color=EVICTED, ls="", label="evicted"),
        plt.Line2D([], [], marker="o", ms=4, color=POISON, ls="", label="poisoned (audit)"),
        plt.Line2D([], [], marker="X", ms=9, color=VIOLATION, ls="", label="violation: reader \u2190 writer"),
    ]
    leg = ax.legend(handles=owners, title="owner (request)", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, ncol=1 + len(owners) // 16)
    ax.add_artist(leg)
    leg.set_clip_on(False)  # (add_artist clips it to the axes: a tight bounding box left it out, its names cut off)
    ax.legend(handles=keys, loc="lower left", bbox_to_anchor=(1.01, 0.0), fontsize=7)
    fig.tight_layout()
    return fig


def write_png(trace: Trace, out: str | Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt

    fig = figure(trace, title)
    fig.savefig(out, dpi=130, bbox_inches="tight")  # the legends outside the axes stay in the image
    plt.close(fig)
    return Path(out)


def write_html(trace: Trace, out: str | Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt

    fig = figure(trace, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    img = base64.b64encode(buf.getvalue()).decode()
    rows = []
    by_block: dict[int, list[dict]] = {}
    for r in trace.records:
        by_block.setdefault(r["block"], []).append(r)
    for b in sorted(by_block):
        cells = []
        for r in by_block[b]:
            extra = {k: v for k, v in r.items() if k not in ("step", "event", "block", "request", "scope")}
            text = f"{r['step']}: {r['event']} {r['request'] or ''}" + (f" {extra}" if extra else "")
            style = ' style="color:#d00000;font-weight:bold"' if r["event"] == "violation" else ""
            cells.append(f"<span{style}>{html.escape(text)}</span>")
        rows.append(f"<tr><td>{b}</td><td>{'<br>'.join(cells)}</td></tr>")
    page = (
        "<!doctype html><meta charset='utf-8'><title>isolab lifecycle</title>"
        "<style>body{font-family:sans-serif}td{vertical-align:top;border-top:1px solid #ddd;padding:4px;font-size:12px}</style>"
        f"<h1>{html.escape(title or 'KV block lifecycle')}</h1><img src='data:image/png;base64,{img}' style='max-width:100%'>"
        f"<h2>Events per block</h2><table><tr><th>block</th><th>step: event request extra</th></tr>{''.join(rows)}</table>"
    )
    Path(out).write_text(page, encoding="utf-8")
    return Path(out)
