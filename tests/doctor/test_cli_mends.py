"""`isolab doctor` on bad input, as a user types it: one sentence on stderr and exit 2, never a stack
trace, and nothing left behind (outputs checked before the work, engine flags checked before use,
HTTP targets that cannot be diagnosed, the --tiny model's temporary folder)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from isolab.doctor.http_target import HttpTarget
from isolab.doctor.workload import load_jsonl
from isolab.errors import InvalidRequestError
from isolab.testing.cli import isolab
from isolab.testing.cli import one_sentence as _one_sentence


def one_sentence(out: subprocess.CompletedProcess, needle: str) -> None:
    _one_sentence(out, needle, ignore_prefix="  running ")  # doctor's progress lines


# -- 1. outputs are checked before any work ----------------------------------------------------------
def test_unwritable_json_is_refused_before_the_work_and_the_plot(tmp_path):
    plot = tmp_path / "ok.png"
    out = isolab("doctor", "--tiny", "--json", "/nonexistent/d.json", "--plot", str(plot), timeout=30)
    one_sentence(out, "--json '/nonexistent/d.json'")
    assert "running" not in out.stderr and not plot.exists()


@pytest.mark.parametrize("name,needle", [("afile/p.png", "the folder"), ("p.nosuchformat", "name a .png file")])
def test_unwritable_plot_is_refused_before_the_work(tmp_path, name, needle):
    (tmp_path / "afile").write_text("a file, not a folder")
    out = isolab("doctor", "--tiny", "--plot", str(tmp_path / name), timeout=30)
    one_sentence(out, needle)


def test_engine_trace_in_a_missing_folder_is_refused(tmp_path):
    out = isolab("doctor", "--tiny", "--engine-args", "--trace /nonexistent/t.jsonl", timeout=30)
    one_sentence(out, "--trace")


# -- 3. engine flags are checked before they are used ------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    ("--block-size 0", "block_size must be between 1 and 1024"),
    ("--block-size 5000", "block_size must be between 1 and 1024"),
    ("--max-num-seqs 0", "max_num_seqs"),
    ("--max-model-len 0", "max_model_len"),
])
def test_engine_args_are_checked_before_use(flags, needle):
    out = isolab("doctor", "--tiny", "--engine-args", flags, timeout=30)
    one_sentence(out, needle)


# -- 2. HTTP targets that cannot be diagnosed --------------------------------------------------------
class _Fixed(BaseHTTPRequestHandler):
    """Answers every request with the server's (status, content type, body)."""

    answer: tuple[int, str, bytes] = (404, "text/html", b"")

    def _send(self) -> None:
        status, kind, body = self.answer
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _send  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


PAGE_404 = b"<html>\n<head><title>404 Not Found</title></head>\n<body>\n<h1>Not Found</h1>\n</body>\n</html>\n"
ANSWERS = {
    "404": (404, "text/html", PAGE_404),
    "401": (401, "application/json", b'{"error": {"message": "bad key"}}'),
    "html200": (200, "text/html", b"<html>\n<body>hello</body>\n</html>\n"),
}


@pytest.fixture
def server(request) -> Iterator[str]:
    handler = type("H", (_Fixed,), {"answer": ANSWERS[request.param]})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_one_sentence():
    one_sentence(isolab("doctor", "--base-url", f"http://127.0.0.1:{_closed_port()}", timeout=60), "cannot reach")


@pytest.mark.parametrize("url", ["notaurl", "ftp://example.com", "http://[::1"])
def test_a_url_that_is_not_http_is_one_sentence(url):
    one_sentence(isolab("doctor", "--base-url", url, timeout=30), "--base-url")


@pytest.mark.parametrize("server,extra,needle", [
    ("404", [], "gave no model (HTTP 404)"),
    ("401", ["--api-key", "wrong"], "refused the key (HTTP 401)"),
    ("401", ["--api-key", "wrong", "--model-name", "m"], "refused the key (HTTP 401)"),
    ("html200", [], "gave no model (HTTP 200)"),
    ("404", ["--model-name", "m"], "every request failed even alone, e.g.: HTTP 404"),
    ("html200", ["--model-name", "m"], "not an OpenAI completion"),
], indirect=["server"], ids=["404", "401", "401-model", "html", "404-model", "html-model"])
def test_a_server_that_cannot_be_diagnosed_is_one_sentence(server, extra, needle):
    one_sentence(isolab("doctor", "--base-url", server, "--concurrency", "1", *extra, timeout=60), needle)


def test_tiny_with_a_server_is_refused_not_ignored():
    one_sentence(isolab("doctor", "--tiny", "--base-url", "http://127.0.0.1:1", timeout=30), "--tiny or --base-url")


def test_http_target_errors_are_invalid_request_errors():
    """The same in process (httpx transports, no sockets): no httpx exception escapes."""
    def refuse(r: httpx.Request) -> httpx.Response:
        return httpx.Response(403, text="no")

    def down(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=r)

    with pytest.raises(InvalidRequestError, match="refused the key"):
        HttpTarget("http://mock", transport=httpx.MockTransport(refuse)).connect()
    with pytest.raises(InvalidRequestError, match="cannot reach"):
        HttpTarget("http://mock", transport=httpx.MockTransport(down)).connect()
    with pytest.raises(InvalidRequestError, match="not an http"):
        HttpTarget("localhost:8000")


def test_a_workload_that_is_not_text_is_one_sentence(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_bytes(bytes(range(128, 256)))
    with pytest.raises(InvalidRequestError, match="not UTF-8 text"):
        load_jsonl(f)


# -- 9. the --tiny model's temporary folder goes when the command ends ------------------------------
def _scratch(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("isolab-*"))


def test_tiny_run_leaves_no_temporary_folder(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = isolab("doctor", "--tiny", "--concurrency", "1", env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert _scratch(tmp_path) == []


def test_tiny_run_ended_by_sigterm_leaves_no_temporary_folder(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "isolab.cli", "doctor", "--tiny"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("isolab-*/tiny.gguf")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "doctor ended before the test could stop it"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert _scratch(tmp_path) == []


@pytest.mark.parametrize("spec", ["=x", " =false", "nofield"])
def test_a_no_cache_field_without_a_name_is_refused(spec):
    from isolab.doctor.http_target import parse_field

    with pytest.raises(InvalidRequestError, match="write FIELD=VALUE"):
        parse_field(spec)
    assert parse_field("cache_prompt=false") == parse_field(" cache_prompt=false") == {"cache_prompt": False}


@pytest.mark.parametrize("flag", [["--api-key", "k"], ["--model-name", "m"], ["--scope-field", "salt"],
                                  ["--no-cache-field", "cache_prompt=false"], ["--tie-margin", "0.5"]])
def test_server_flags_without_a_server_are_refused(flag):
    """The flags only a --base-url target reads were ignored without a word on the engine in process."""
    one_sentence(isolab("doctor", "--tiny", *flag, timeout=60), f"{flag[0]} is for a server: it needs --base-url")


def test_a_server_that_never_answers_stops_at_the_first_request():
    """A server that lists its models but never answers a completion: the first request's timeout ends
    the run in one sentence (it waited --timeout for each of the 56 alone requests: most of two hours)."""
    from isolab.doctor.experiments import diagnose
    from isolab.doctor.workload import builtin_workload

    calls = []

    def stuck(r: httpx.Request) -> httpx.Response:
        if r.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        calls.append(r)
        raise httpx.ReadTimeout("timed out", request=r)

    target = HttpTarget("http://mock", transport=httpx.MockTransport(stuck), timeout_s=7)
    with pytest.raises(InvalidRequestError, match=r"no answer to the first request alone \(ReadTimeout: timed out; "
                                                  r"--timeout 7 s\)"):
        diagnose(target, builtin_workload(), concurrencies=(1,))
    assert len(calls) == 1


def test_timeout_is_checked_and_is_for_a_server():
    one_sentence(isolab("doctor", "--base-url", "http://127.0.0.1:1", "--timeout", "0", timeout=30),
                 "--timeout must be a positive number of seconds")
    one_sentence(isolab("doctor", "--tiny", "--timeout", "5", timeout=30), "--timeout is for a server")


def test_tiny_with_a_model_in_the_engine_args_is_refused_not_ignored():
    one_sentence(isolab("doctor", "--tiny", "--engine-args", "--model smollm2-135m-instruct", timeout=60),
                 "--tiny or --model in --engine-args")
