"""Owns `isolab lifecycle TRACE --out FILE.png|.html`: draw a block lifecycle trace (claim C16).

Prints the trace's completeness (every block life ended, still held, or cached) and its audit
violations; exit 1 when the trace is incomplete.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lifecycle", help="draw a block lifecycle trace (from --trace) as a PNG or HTML page",
                       description="Draw a block lifecycle trace (from --trace) as a PNG or HTML page. Exit status: "
                                   "0 every block life accounted for and no audit violation, 1 a violation or "
                                   "missing events (the picture is drawn either way), 2 a trace or --out it cannot use.")
    p.add_argument("trace", help="the JSONL file written by --trace")
    p.add_argument("--out", required=True, metavar="FILE.png|FILE.html")
    p.add_argument("--title", default="")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from isolab.commands.outputs import check_output_path
    from isolab.errors import InvalidRequestError
    from isolab.lifecycle.draw import write_html, write_png
    from isolab.lifecycle.trace import completeness, load, summary_lines

    out = str(args.out)
    if not out.endswith((".png", ".html", ".htm")):
        raise InvalidRequestError(f"--out {out!r}: name a .png or .html file", field="out")
    check_output_path(out, "--out")  # before reading and drawing: an unwritable path is a sentence now
    trace = load(args.trace)
    if not trace.records:
        raise InvalidRequestError(f"the trace {args.trace} holds no events: was the engine run with --trace?", field="trace")
    (write_png if out.endswith(".png") else write_html)(trace, out, args.title)
    print("\n".join(summary_lines(trace)))
    print(f"wrote {out}")
    return 0 if completeness(trace)["complete"] and not trace.violations else 1  # (2: input it cannot read)
