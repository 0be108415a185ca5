"""`isolab probe` on values that make no sense: refused with one sentence before any request (exit 2),
and a --report folder that cannot be written is refused before the probe runs."""

from __future__ import annotations

import math
import socket
import subprocess

import pytest

from isolab.probe.verdicts import Thresholds
from isolab.testing.cli import isolab


def _closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def one_sentence(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert needle in out.stderr and "cannot reach" not in out.stderr, out.stderr  # refused before any request


@pytest.mark.parametrize("flags,needle", [
    (["--margin", "nan"], "--margin must be a finite number"),
    (["--margin", "inf"], "--margin must be a finite number"),
    (["--margin", "-0.5"], "--margin must be a finite number"),
    (["--timing", "-5"], "--timing takes at least 5 samples"),
    (["--timing", "2"], "--timing takes at least 5 samples"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--timeout", "nan"], "--timeout must be a positive number"),
    (["--first-blocks", "-1"], "--first-blocks must be 0 or more"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_values_that_make_no_sense_are_refused(flags, needle):
    one_sentence(isolab("probe", "--base-url", _closed_url(), "--no-progress", *flags), needle)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:9", "127.0.0.1:8000", "http://"])
def test_a_base_url_that_is_not_http_is_refused_as_the_doctor_refuses_it(url):
    """(ftp:// was 'cannot reach ... UnsupportedProtocol' after the probe started); the prefix is every
    command's `isolab: error:`."""
    out = isolab("probe", "--base-url", url, "--no-progress")
    one_sentence(out, "is not an http:// or https:// URL")
    assert out.stderr.startswith("isolab: error: --base-url")


@pytest.mark.parametrize("where", ["file", "under-a-file", "nested-under-a-file"])
def test_unwritable_report_folder_is_refused_before_the_probe(tmp_path, where):
    f = tmp_path / "afile"
    f.write_text("a file, not a folder")
    report = {"file": f, "under-a-file": f / "rep", "nested-under-a-file": f / "a" / "rep"}[where]
    one_sentence(isolab("probe", "--base-url", _closed_url(), "--no-progress", "--report", str(report)), "--report")


def test_missing_report_folders_are_still_fine(tmp_path):
    """write_report makes missing folders: the check must not refuse them (the probe then fails to connect)."""
    out = isolab("probe", "--base-url", _closed_url(), "--no-progress", "--report", str(tmp_path / "a" / "b"))
    assert out.returncode == 2 and "cannot reach" in out.stderr and "Traceback" not in out.stderr


def test_thresholds_refuse_nan():
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="margin"):
            Thresholds(margin=bad)
    assert Thresholds(margin=0.0).margin == 0.0


def test_probe_config_refuses_negative_sizes_and_bad_timeouts():
    from isolab.probe import ProbeConfig, ProbeUsageError, Sizes

    for kw in (dict(sizes=Sizes(timing_samples=-1)), dict(sizes=Sizes(first_blocks=-1)), dict(timeout_s=math.nan),
               dict(timeout_s=0.0)):
        with pytest.raises(ProbeUsageError):
            ProbeConfig("http://x", **kw)  # type: ignore[arg-type]


def test_probe_config_takes_one_or_two_distinct_keys():
    """A third key was never read, and the same key twice made one tenant look like two."""
    from isolab.probe import ProbeConfig, ProbeUsageError

    with pytest.raises(ProbeUsageError, match="a third would not be read"):
        ProbeConfig("http://x", api_keys=("a", "b", "c"))
    with pytest.raises(ProbeUsageError, match="the same key"):
        ProbeConfig("http://x", api_keys=("a", "a"))
    assert ProbeConfig("http://x", api_keys=("a", "b")).api_keys == ("a", "b")
