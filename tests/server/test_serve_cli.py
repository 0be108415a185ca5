"""`isolab serve` as a process: it refuses to start without keys, and SIGTERM drains running
requests up to --drain-timeout, ends what is left (an error event and [DONE]), and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from isolab.testing.live_server import free_port


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ISOLAB_API_KEYS"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_refuses_to_start_without_keys():
    p = subprocess.run([sys.executable, "-m", "isolab.cli", "serve", "--port", str(free_port())],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no API keys configured" in p.stderr and "--no-auth" in p.stderr


def test_refuses_an_unreadable_chat_template(tmp_path):
    p = subprocess.run([sys.executable, "-m", "isolab.cli", "serve", "--no-auth", "--chat-template",
                        str(tmp_path / "missing.jinja")], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--chat-template" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "empty.jinja").write_text("\n")
    p = subprocess.run([sys.executable, "-m", "isolab.cli", "serve", "--no-auth", "--chat-template",
                        str(tmp_path / "empty.jinja")], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "is empty" in p.stderr and "Traceback" not in p.stderr


def test_refuses_a_bad_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("only-one-field\n")
    p = subprocess.run([sys.executable, "-m", "isolab.cli", "serve", "--api-keys", str(f)],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "expected 'KEY TENANT'" in p.stderr


class _Stream(threading.Thread):
    """A streamed completion read in the background: its events, whether it saw [DONE]."""

    def __init__(self, url: str, key: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.max_tokens = url, key, max_tokens
        self.events: list[dict] = []
        self.done = False
        self.first = threading.Event()
        self.error: BaseException | None = None
        self.status: int | None = None

    def run(self) -> None:
        body = {"prompt": "Tell me a long story about a cat.", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {self.key}"}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.first.set()
        except (httpx.HTTPError, OSError) as exc:
            self.error = exc
        finally:
            self.first.set()


@contextlib.contextmanager
def _served(tmp_path, drain_timeout: int) -> Iterator[tuple[subprocess.Popen, str]]:
    """`isolab serve` on the real model as a process, up (its /health answered), killed if a test
    leaves it running; its log is tmp_path/server.log."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-test": "t1"}))
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolab.cli", "serve", "--api-keys", str(keys), "--port", str(port),
         "--device", "cpu", "--kv-cache-memory", "128MiB", "--drain-timeout", str(drain_timeout)],
        env=_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(tmp_path / "server.log").read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.real
@pytest.mark.slow
def test_sigterm_drains_running_requests_then_ends_the_rest_before_the_timeout(tmp_path):
    with _served(tmp_path, drain_timeout=15) as (proc, url):
        medium, endless = _Stream(url, "sk-test", 16), _Stream(url, "sk-test", 3000)
        medium.start()
        endless.start()
        assert medium.first.wait(60) and endless.first.wait(60)
        assert medium.status == endless.status == 200 and medium.events and endless.events
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        medium.join(30)
        endless.join(30)
    text = open(tmp_path / "server.log").read()
    # the medium request was still running at the signal, and it was finished, not cut
    assert "draining running requests" in text
    assert medium.done, text[-2000:]
    assert medium.events[-1]["usage"]["completion_tokens"] == 16
    drained_at = text.index("draining running requests")
    assert "output_tokens=16" in text[drained_at:], "the medium request had finished before the signal"
    # the endless one was ended just before the drain timeout ran out: an error event and [DONE],
    # not a body cut mid-stream
    assert endless.done and endless.error is None
    assert [e["error"]["message"] for e in endless.events if "error" in e] == ["the server is shutting down"]
    assert "usage" in endless.events[-1]  # include_usage: the usage chunk still closes it
    assert sum(1 for e in endless.events if e.get("choices") and e["choices"][0]["text"]) < 3000
    assert "timeout graceful shutdown exceeded" not in text


@pytest.mark.real
@pytest.mark.slow
def test_a_second_signal_ends_the_drain_now_without_cutting_a_stream(tmp_path):
    """SIGTERM, then Ctrl-C a second later (an impatient operator): the requests left end at once
    the clean way, an error event and [DONE] each, never a body cut mid-stream or a traceback, and
    the process exits 0 long before --drain-timeout."""
    with _served(tmp_path, drain_timeout=60) as (proc, url):
        streams = [_Stream(url, "sk-test", 3000) for _ in range(3)]
        for st in streams:
            st.start()
        assert all(st.first.wait(60) for st in streams)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert time.monotonic() - signalled < 30  # not the 60 s drain
        for st in streams:
            st.join(30)
    text = open(tmp_path / "server.log").read()
    assert "ending the running requests now" in text and "Traceback" not in text, text[-3000:]
    assert "finish=shutdown" in text  # the log tells a drain's end from a client's abort
    for st in streams:
        assert st.done and st.error is None, (st.error, text[-2000:])
        assert [e["error"]["message"] for e in st.events if "error" in e] == ["the server is shutting down"]
