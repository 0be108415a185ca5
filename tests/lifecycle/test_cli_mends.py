"""`isolab lifecycle` on bad input: a file that is not text, records of the wrong types, and an --out
that cannot be written are each one sentence and exit 2, never a stack trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from isolab.testing.cli import isolab as run_isolab
from isolab.testing.cli import one_sentence

GOOD = {"step": 1, "event": "allocated", "block": 3, "request": "A", "scope": None, "generation": 0}


def isolab(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return run_isolab(*args, timeout=timeout)


def test_a_binary_file_is_one_sentence(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)))
    one_sentence(isolab("lifecycle", str(trace), "--out", str(tmp_path / "x.png")), "is not UTF-8 text")


@pytest.mark.parametrize("change", [{"step": "a"}, {"block": "3"}, {"block": None}, {"event": ["freed"]},
                                   {"request": 5}, {"refs": "1"}, {"step": 1.5}], ids=str)
def test_records_of_the_wrong_types_are_one_sentence(tmp_path, change):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "event": "released", **change}) + "\n")
    one_sentence(isolab("lifecycle", str(trace), "--out", str(tmp_path / "x.png")), "line 2 is not a block event")


@pytest.fixture
def trace(tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps(GOOD) + "\n")
    return t


@pytest.mark.parametrize("out", ["/nonexistent/x.png", "AFILE/x.png", "AFILE/x.html", "DIR.png"])
def test_an_out_that_cannot_be_written_is_one_sentence(tmp_path, trace, out):
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "DIR.png").mkdir()
    out = out.replace("AFILE", str(tmp_path / "afile")).replace("DIR", str(tmp_path / "DIR"))
    result = isolab("lifecycle", str(trace), "--out", out)
    one_sentence(result, "--out")
    assert result.stdout == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_out_in_a_read_only_folder_is_one_sentence(tmp_path, trace):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_sentence(isolab("lifecycle", str(trace), "--out", str(ro / "x.png")), "cannot be written")
    finally:
        ro.chmod(0o755)


def test_a_good_trace_still_draws(tmp_path, trace):
    out = isolab("lifecycle", str(trace), "--out", str(tmp_path / "x.html"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "x.html").exists()


def test_a_write_the_system_refuses_after_the_checks_is_one_sentence(trace):
    """/proc passes the up-front check for root (and fails it otherwise); either way, one sentence."""
    one_sentence(isolab("lifecycle", str(trace), "--out", "/proc/isolab-x.html"), "/proc/isolab-x.html")


@pytest.mark.parametrize("out,trace,needle", [("x.png", "missing/m.jsonl", "--trace"), ("x.txt", None, "--out"),
                                              ("missing/x.png", None, "--out")])
def test_the_demo_refuses_bad_outputs_before_its_run(tmp_path, out, trace, needle):
    argv = ["--out", str(tmp_path / out)] + (["--trace", str(tmp_path / trace)] if trace else [])
    res = subprocess.run([sys.executable, "-m", "isolab.lifecycle.demo", *argv], capture_output=True, text=True, timeout=60)
    one_sentence(res, needle)


def test_the_demo_says_what_isolab_lifecycle_says_and_leaves_no_folder(tmp_path):
    """It printed a Python dict, and left its tiny model and trace in two temporary folders."""
    import os

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = subprocess.run([sys.executable, "-m", "isolab.lifecycle.demo", "--out", str(tmp_path / "d.png")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
    assert res.returncode == 0, res.stderr
    assert "block lives over" in res.stdout and "{" not in res.stdout and f"wrote {tmp_path / 'd.png'}" in res.stdout
    assert (tmp_path / "d.png").stat().st_size > 0 and not list(scratch.iterdir())


def test_the_owners_legend_stays_inside_the_image():
    """Long request ids (a server's cmpl-<32 hex>) were cut off at the image's right edge: the legend,
    added to the axes, was clipped out of the layout."""
    import matplotlib

    matplotlib.use("Agg")
    from isolab.lifecycle.draw import figure
    from isolab.lifecycle.trace import build

    recs = []
    for b in range(1, 13):
        who = f"cmpl-{b:032x}-0"
        recs += [{"step": b, "event": "allocated", "block": b, "request": who, "scope": None},
                 {"step": b + 1, "event": "released", "block": b, "request": who, "scope": None, "refs": 0},
                 {"step": b + 1, "event": "freed", "block": b, "request": who, "scope": None}]
    fig = figure(build(recs))
    renderer = fig.canvas.get_renderer()
    right = fig.bbox.x1
    for legend in (a for a in fig.axes[0].get_children() if type(a).__name__ == "Legend"):
        assert legend.get_window_extent(renderer).x1 <= right + 1, "a legend runs past the image"
