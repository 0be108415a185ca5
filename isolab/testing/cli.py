"""The `isolab` command as a test runs it: a subprocess, and the check that an error is one sentence."""

from __future__ import annotations

import subprocess
import sys


def isolab(*args: str, timeout: int = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "isolab.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def one_sentence(out: subprocess.CompletedProcess[str], needle: str, *, ignore_prefix: str | None = None) -> None:
    """Exit code 2 and exactly one line on stderr, `isolab: error: ...` holding needle (lines that start
    with ignore_prefix, a command's progress, aside); never a traceback."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not (ignore_prefix and ln.startswith(ignore_prefix))]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("isolab: error: ") and needle in lines[0], out.stderr
