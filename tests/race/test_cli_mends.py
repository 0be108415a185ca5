"""`isolab race` and `isolab passcode serve` on bad input: one sentence and exit 2, never a stack trace
or a hang (thread counts past a sane bound, threads the system will not start, ports out of range,
rate limits that make no sense, outputs that cannot be written)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from isolab.cli import main
from isolab.errors import InvalidRequestError
from isolab.race.checkers import VARIANTS
from isolab.race.stress import MAX_THREADS, StressConfig, run_once


def one_sentence(argv: list[str], capsys, needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("isolab: error: ") and err.count("\n") == 1 and needle in err, err


# -- 4. threads -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["race", "stress", "--threads", "100000", "--requests", "200000", "--repeat", "1"],
    ["race", "stress", "--threads", "2,5000", "--requests", "200000", "--repeat", "1"],
    ["race", "bench", "--threads", "100000", "--requests", "200000"],
])
def test_thread_counts_past_the_bound_are_refused(argv, capsys):
    one_sentence(argv, capsys, f"at most {MAX_THREADS}")


def test_the_cli_refuses_huge_thread_counts_quickly_without_hanging():
    out = subprocess.run([sys.executable, "-m", "isolab.cli", "race", "stress", "--threads", "100000", "--requests",
                          "200000", "--repeat", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("failure,expected", [(RuntimeError("can't start new thread"), InvalidRequestError),
                                              (KeyboardInterrupt(), KeyboardInterrupt)], ids=["limit", "ctrl-c"])
def test_threads_that_will_not_start_end_the_run_cleanly(monkeypatch, failure, expected):
    """The 4th thread fails to start (the system's limit, or Ctrl-C): the 3 started leave (no hang),
    and a limit is a sentence."""
    real_start = threading.Thread.start
    started = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("stress-") and len(started) >= 3:
            raise failure
        started.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    t0 = time.monotonic()
    with pytest.raises(expected) as exc:
        run_once(VARIANTS["buggy"], StressConfig(8, 800))
    if expected is InvalidRequestError:
        assert "could start only 3 of 8 threads" in str(exc.value)
    assert time.monotonic() - t0 < 30
    assert len(started) == 3 and not any(t.is_alive() for t in started)


# -- 5. the passcode service ------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["--port", "-1"], "--port must be between 0 and 65535"),
    (["--max-attempts", "-1"], "--max-attempts must be 0 (no limit) or more"),
    (["--window", "0"], "--window must be a positive number of seconds"),
    (["--window", "-3"], "--window must be a positive number of seconds"),
    (["--window", "nan"], "--window must be a positive number of seconds"),
    (["--scrypt-n", str(2**24)], "--scrypt-n"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_passcode_serve_refuses_settings_that_make_no_sense(flags, needle, capsys, monkeypatch):
    monkeypatch.setenv("ISOLAB_PASSCODE", "hunter2")
    one_sentence(["passcode", "serve", *flags], capsys, needle)


def test_passcode_serve_on_a_port_in_use_is_one_sentence(capsys, monkeypatch):
    monkeypatch.setenv("ISOLAB_PASSCODE", "hunter2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        one_sentence(["passcode", "serve", "--port", str(s.getsockname()[1]), "--scrypt-n", "2"], capsys,
                     "cannot listen on 127.0.0.1")


# -- 1. outputs are checked before the work ---------------------------------------------------------
@pytest.fixture
def afile(tmp_path: Path) -> Path:
    f = tmp_path / "afile"
    f.write_text("a file, not a folder")
    return f


@pytest.mark.parametrize("argv", [
    ["race", "stress", "--threads", "2", "--requests", "10", "--repeat", "1", "--json", "AFILE/x.json"],
    ["race", "stress", "--threads", "2", "--requests", "10", "--repeat", "1", "--json", "AFILE/deeper/x.json"],
    ["race", "stress", "--threads", "2", "--requests", "10", "--repeat", "1", "--plot", "AFILE/x.png"],
    ["race", "stress", "--threads", "2", "--requests", "10", "--repeat", "1", "--plot", "TMP/x.nosuchformat"],
    ["race", "explore", "passcode:buggy", "--switch", "gil", "--bound", "1", "--save", "AFILE/s.txt"],
    ["race", "bench", "--requests", "10", "--repeat", "1", "--json", "AFILE/b.json"],
])
def test_unwritable_outputs_are_refused_before_the_work(argv, afile, capsys):
    argv = [a.replace("AFILE", str(afile)).replace("TMP", str(afile.parent)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("isolab: error: ") and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""  # no run, no search: refused first


def test_outputs_in_missing_folders_are_still_made(tmp_path):
    out = tmp_path / "a" / "b" / "stress.json"
    assert main(["race", "stress", "--variant", "lock_local", "--threads", "2", "--requests", "40", "--repeat", "1",
                 "--json", str(out)]) == 0
    assert out.exists()


def test_a_schedule_that_is_not_text_is_one_sentence(tmp_path, capsys):
    bad = tmp_path / "f.schedule"
    bad.write_bytes(b"garbage\x00\xff")
    one_sentence(["race", "explore", "--replay", str(bad)], capsys, "not an isolab schedule file")


def test_a_write_the_system_refuses_after_the_checks_is_one_sentence(capsys):
    """/proc passes the up-front check for root: the write itself fails, still as one sentence."""
    assert main(["race", "stress", "--threads", "2", "--requests", "100", "--repeat", "1", "--json",
                 "/proc/isolab-x.json"]) == 2
    err = capsys.readouterr().err  # the runs' progress lines, then the sentence
    assert "Traceback" not in err and err.splitlines()[-1].startswith("isolab: error: ") and "/proc/isolab-x.json" in err


@pytest.mark.parametrize("argv,needle", [(["--threads", "0"], "--threads must be at least 1"),
                                         (["--repeat", "0"], "--repeat must be at least 1"),
                                         (["--json", "/nonexistent/x.json"], "--json")])
def test_the_race_bench_script_refuses_bad_input_in_one_sentence(argv, needle):
    out = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench" / "race_bench.py"), *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and needle in out.stderr, out.stderr


@pytest.mark.parametrize("argv,needle", [
    # NaN passed a `<= 0` check and aborted the interpreter (take_gil); inf became a 0 s interval
    (["race", "stress", "--threads", "2", "--requests", "200", "--repeat", "1", "--switch-interval", "nan"],
     "switch interval must be a number of seconds"),
    (["race", "stress", "--threads", "2", "--requests", "200", "--repeat", "1", "--switch-interval", "inf"],
     "switch interval must be a number of seconds"),
    (["race", "stress", "--variant", ",,", "--threads", "2", "--requests", "200"], "names no variant"),
    (["race", "explore", "passcode:buggy", "--trace-module", ""], "is not a module name"),
    (["race", "explore", "passcode:buggy", "--trace-module", ".x"], "is not a module name"),
    (["race", "explore", "passcode:buggy", "--stall-seconds", "nan"], "must be positive"),
    (["race", "explore", "passcode:buggy", "--time-limit", "nan"], "must be positive"),
])
def test_values_a_black_box_pass_found_are_one_sentence(argv, capsys, needle):
    one_sentence(argv, capsys, needle)


def test_an_output_folder_root_may_not_write_in_is_refused_before_the_work(capsys):
    """os.access says yes to root for /proc, where no file can be made: the check makes one (the run
    went first and failed at its end)."""
    one_sentence(["race", "stress", "--threads", "2", "--requests", "200", "--repeat", "1", "--json", "/proc/x.json"],
                 capsys, "cannot be written")


def test_an_existing_file_or_a_pipe_is_written_in_place(tmp_path):
    """`--json >(jq .)` names /dev/fd/N: written in place, so its folder (which no file can be made in)
    is not asked; an existing file likewise."""
    import os

    from isolab.commands.outputs import check_output_path

    r, w = os.pipe()
    try:
        check_output_path(f"/dev/fd/{w}", "--json")
    finally:
        os.close(r)
        os.close(w)
    (tmp_path / "x.json").write_text("{}")
    check_output_path(tmp_path / "x.json", "--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]  # and the folder check left nothing


# -- race bench's service part follows --threads and --requests -------------------------------------
@pytest.mark.parametrize("threads,requests,expected", [(3, 300, 24), (5, 40, 5)])
def test_race_bench_service_part_follows_threads_and_requests(monkeypatch, capsys, threads, requests, expected):
    """The service over loopback runs as many clients as the QPS runs have threads, 8 % of the
    requests (at least one a client): it ran a fixed 8 clients and 8,000 requests before."""
    from isolab.race import bench

    calls: list[tuple[str, int, int]] = []
    real = bench.loopback_load

    def recording(variant: str, clients: int = 8, requests: int = 2000, **kw):
        calls.append((variant, clients, requests))
        return real(variant, clients=clients, requests=requests, **kw)

    monkeypatch.setattr(bench, "loopback_load", recording)
    monkeypatch.setattr(bench, "explorer_speed", lambda: {})  # its own tests: tests/race/test_explorer.py
    payload = bench.run_bench(requests=requests, repeat=1, threads=threads)
    assert calls == [("buggy", threads, expected), ("lock_local", threads, expected)]
    for row in payload["service"].values():
        assert row["requests"] == expected - expected % threads  # each client sends requests // clients
    assert payload["threads"] == threads and "service buggy" in capsys.readouterr().out
