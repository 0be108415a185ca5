"""`isolab race` and `isolab passcode` through the real CLI entry point: exit codes and files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from isolab.cli import main


def test_explore_exits_1_on_a_losing_schedule_and_0_when_it_holds(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "s.txt"
    assert main(["race", "explore", "passcode:buggy", "--switch", "gil", "--bound", "1", "--save", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "FAILED after" in out and "reachable with the GIL" in out and "input_buffer=wrong" in out
    assert main(["race", "explore", "--replay", str(saved), "--times", "3"]) == 1
    assert "reproduced 3 of 3" in capsys.readouterr().out
    assert main(["race", "explore", "passcode:lock_local", "--switch", "gil", "--bound", "1"]) == 0
    assert "HOLDS" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["race", "explore", "passcode:nope"],
    ["race", "explore", "nocolon"],
    ["race", "stress", "--threads", "two"],
    ["race", "stress", "--variant", "nope"],
    ["race", "stress", "--threads", "2,,4"],  # (read as 2,4)
    ["passcode", "serve", "--window", "1e300"],  # (a 301-digit Retry-After)
])
def test_bad_input_exits_2_with_one_sentence(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("isolab: error: ") and err.count("\n") == 1


def test_stress_json_records_false_accepts_and_rejects_per_run(tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    rc = main(["race", "stress", "--variant", "buggy,lock_local", "--threads", "2", "--requests", "400",
               "--repeat", "2", "--json", str(out)])
    assert rc == 0  # forbidden outcomes in the buggy variant are known, not a failure
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 4
    assert all({"false_accepts", "false_rejects", "qps", "threads"} <= set(r) for r in runs)


def test_explore_list_names_the_builtins(capsys) -> None:
    assert main(["race", "explore", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert "passcode:buggy" in names and "fixtures:lost_wakeup" in names


def test_a_ctrl_c_ends_a_long_stress_run_at_once() -> None:
    """It printed "interrupted" and then waited out every worker's requests (17 s for 2M; minutes for more)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "isolab.cli", "race", "stress", "--variant", "buggy", "--threads", "4",
                             "--requests", "100000000", "--repeat", "1"], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(6)  # (the import and the workers' start, on a loaded machine)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(timeout=30)
        assert code == 130 and time.monotonic() - sent < 5, (code, time.monotonic() - sent)
        assert "interrupted" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_right_share_that_leaves_no_race_possible_is_said(capsys) -> None:
    """--right-share 0.1 at 2 threads had both threads send the wrong passcode: buggy graded OK silently."""
    assert main(["race", "stress", "--variant", "buggy", "--threads", "2", "--right-share", "0.1",
                 "--requests", "200"]) == 0
    assert "at 2 threads, --right-share 0.1 has every thread send the wrong passcode" in capsys.readouterr().err


@pytest.mark.parametrize(("env", "argv", "says"), [
    ("   ", [], "set ISOLAB_PASSCODE to the passcode"),  # (spaces were taken as the passcode)
    ("s3cret", ["--host", ""], "--host is empty"),  # (it listened on every interface)
])
def test_a_passcode_of_spaces_and_an_empty_host_are_refused(monkeypatch, capsys, env, argv, says) -> None:
    monkeypatch.setenv("ISOLAB_PASSCODE", env)
    assert main(["passcode", "serve", "--port", "0", *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
def test_passcode_serve_quiet_logs_no_line_a_request(quiet):
    """Each request is a line on stderr (client, route, status, verdict; never the passcode);
    --quiet leaves warnings only."""
    import os
    import re
    import subprocess

    import httpx

    env = dict(os.environ, ISOLAB_PASSCODE="lab-secret-1")
    proc = subprocess.Popen([sys.executable, "-m", "isolab.cli", "passcode", "serve", "--port", "0",
                             "--scrypt-n", "2", *(["--quiet"] if quiet else [])], stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        banner = proc.stderr.readline()
        port = int(re.search(r":(\d+)\s", banner).group(1))
        for guess in ("lab-secret-1", "wrong-guess-2"):
            assert httpx.post(f"http://127.0.0.1:{port}/check", json={"passcode": guess}).status_code == 200
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "lab-secret-1" not in err and "wrong-guess-2" not in err
    assert ("check accepted=" in err) is not quiet, err
