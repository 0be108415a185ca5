"""The black-box tools (`isolab probe`, `isolab doctor`, `isolab bench --url`) against a server that
answers 200 with something other than an OpenAI completion, or is named by a URL no socket takes:
one sentence and exit 2, never a traceback, and never a figure counted from garbage."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from isolab.testing.cli import isolab

REPLIES = {
    "no_choices": ("application/json", json.dumps({"choices": []})),
    "usage_is_text": ("application/json", json.dumps({"choices": [{"text": "a", "index": 0}], "usage": "nope"})),
    "logprobs_is_text": ("application/json", json.dumps({"choices": [{"text": "a", "logprobs": "x"}]})),
    "stream_of_strings": ("text/event-stream", 'data: {"choices": ["x"]}\n\ndata: [DONE]\n\n'),
    "stream_usage_is_text": ("text/event-stream", 'data: {"choices": [{"text": "a"}], "usage": "nope"}\n\ndata: [DONE]\n\n'),
    "html": ("text/html", "<!doctype html><html><body>hello</body></html>"),
    "plain_json": ("application/json", json.dumps({"choices": [{"text": "a"}]})),
}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, ctype: str, body: str) -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # /v1/models (and anything else) lists one model
        self._send("application/json", json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}))

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._send(*REPLIES[self.server.mode])  # type: ignore[attr-defined]


@pytest.fixture()
def garbage() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def one_sentence(out, needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert needle in out.stderr, out.stderr


@pytest.mark.parametrize("mode", ["no_choices", "usage_is_text", "logprobs_is_text"])
def test_probe_takes_a_reply_of_another_shape_as_one_sentence(garbage, mode):
    garbage.mode = mode  # type: ignore[attr-defined]
    out = isolab("probe", "--base-url", _url(garbage), "--no-progress", "--timeout", "5", "--scenario", "seeded",
                 timeout=120)
    one_sentence(out, "not an OpenAI completion")


@pytest.mark.parametrize("mode", ["stream_of_strings", "stream_usage_is_text", "html", "plain_json"])
def test_bench_url_counts_no_completion_from_a_reply_that_is_not_a_stream(garbage, mode, tmp_path):
    """(a stream of strings was an AttributeError's traceback; an HTML page or a plain JSON reply were
    'completed' requests at 0.0 tok/s, exit 0)"""
    garbage.mode = mode  # type: ignore[attr-defined]
    out = isolab("bench", "--num-requests", "2", "--output-len", "2", "--prompt-len", "4", "--concurrency", "1",
                 "--url", _url(garbage), "--json", str(tmp_path / "b.json"), timeout=120)
    one_sentence(out, "no request completed")
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("argv", [
    ["probe", "--base-url", "http://127.0.0.1:99999", "--no-progress", "--timeout", "5"],
    ["doctor", "--base-url", "http://127.0.0.1:99999", "--timeout", "5", "--concurrency", "1"],
    ["bench", "--url", "http://127.0.0.1:99999", "--num-requests", "1", "--output-len", "1", "--prompt-len", "4"],
])
def test_a_port_no_socket_takes_is_not_a_url(argv):
    """(probe and doctor printed an OverflowError's traceback; bench said 'cannot reach')"""
    one_sentence(isolab(*argv, timeout=120), "a port is 1 to 65535")


@pytest.mark.parametrize("argv,needle", [
    (["bench", "--url", "", "--num-requests", "1"], "--url is empty"),
    (["doctor", "--base-url", ""], "--base-url is empty"),
    (["probe", "--base-url", ""], "--base-url is empty"),
    (["bench", "--num-requests", "1", "--json="], "--json is empty"),
    (["generate", "hi", "--trace", ""], "--trace is empty"),
    (["race", "stress", "--json", ""], "--json is empty"),
])
def test_an_empty_file_or_url_is_refused_not_taken_as_not_given(argv, needle):
    """(an unset $URL ran the engine in-process, exit 0; --json "" and --trace "" wrote nothing, exit 0)"""
    out = isolab(*argv, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and needle in out.stderr, out.stderr


def test_bench_url_waits_only_its_timeout_for_a_server_that_never_answers():
    """(it waited its fixed 600 s in silence; probe and doctor had --timeout, bench had none)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # takes connections (the kernel's backlog) and never answers
        start = time.monotonic()
        out = isolab("bench", "--url", f"http://127.0.0.1:{s.getsockname()[1]}", "--num-requests", "1",
                     "--output-len", "1", "--prompt-len", "4", "--timeout", "2", timeout=120)
    one_sentence(out, "cannot reach")
    assert time.monotonic() - start < 60
    one_sentence(isolab("bench", "--num-requests", "1", "--timeout", "5", timeout=60), "--timeout shapes the requests")
    out = isolab("bench", "--url", "http://127.0.0.1:9", "--timeout", "nan", timeout=60)  # argparse's usage, then
    assert out.returncode == 2 and "Traceback" not in out.stderr and "positive number" in out.stderr  # one line
