"""isolab.bench.http_bench against a real uvicorn: counts, tokens from usage, latency figures."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from isolab.bench.http_bench import percentiles, run_http_bench
from isolab.cli import main
from isolab.errors import IsolabError
from isolab.server import TenantRegistry
from isolab.server.settings import model_slug


def test_percentiles():
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["mean"] == pytest.approx(50.5)


@pytest.mark.parametrize("keepalive", [True, False])  # False: a connection a request (server_compare)
def test_run_http_bench_counts_every_token(server_factory, tiny_bundle, keepalive):
    srv = server_factory(tiny_bundle, tenants=TenantRegistry({"sk-b": "bench"}))
    prompts = [f"prompt {i}" for i in range(6)]
    r = run_http_bench(srv.url + "/v1", "sk-b", None, prompts, [8, 8, 8, 5, 5, 5], 3, keepalive=keepalive)
    assert r["completed"] == 6 and r["failed"] == 0 and r["errors"] == [] and r["keepalive"] is keepalive
    assert r["output_tokens"] == 39 and r["tokens_counted_from"] == "usage"
    assert r["model"] == model_slug(srv.engine.bundle.path.stem) and r["output_tokens_per_s"] > 0
    assert r["ttft_s"]["p50"] is not None and r["e2e_s"]["p99"] >= r["ttft_s"]["p99"]
    assert set(r) >= {"client_cpu_s", "client_cpu_us_per_chunk"}
    bad = run_http_bench(srv.url, "sk-wrong", r["model"], prompts[:2], [4, 4], 2)
    assert bad["completed"] == 0 and bad["failed"] == 2 and "HTTP 401" in bad["errors"][0]


def test_an_unreachable_or_unlisted_server_is_one_sentence(server_factory, tiny_bundle, capsys):
    with pytest.raises(IsolabError, match="cannot reach http://127.0.0.1:9"):
        run_http_bench("http://127.0.0.1:9/v1", None, None, ["p"], [4], 1)
    srv = server_factory(tiny_bundle, tenants=TenantRegistry({"sk-b": "bench"}))
    with pytest.raises(IsolabError, match="answered HTTP 401"):
        run_http_bench(srv.url, "sk-wrong", None, ["p"], [4], 1)
    assert main(["bench", "--url", "http://127.0.0.1:9", "--num-requests", "1", "--concurrency", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("isolab: error: cannot reach") and "Traceback" not in err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--served-model", "m", "--num-requests", "1",
                 "--concurrency", "1"]) == 2
    assert "no request completed against http://127.0.0.1:9" in capsys.readouterr().err


def _sse_server(body: bytes) -> tuple[str, socket.socket]:
    """A one-shot HTTP server on loopback that answers any request with `body` as an event stream."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.mark.parametrize("body, counted, error", [
    # a 3 MiB event (a big logprobs answer) is one line the client must take whole
    (b"data: " + json.dumps({"choices": [{"text": "x" * (3 << 20)}]}).encode() + b"\n\ndata: [DONE]\n\n", 1, None),
    (b"data: {\"a\": \"\xff\"}\n\n", 0, "UnicodeDecodeError"),
    (b"data: [1, 2]\n\n", 0, "not a JSON object"),
    (b"data: {\"choices\": [\n\n", 0, "JSONDecodeError"),
])
def test_a_stream_the_client_cannot_read_fails_that_request_only(body, counted, error):
    url, sock = _sse_server(body)
    try:
        r = run_http_bench(url, None, "m", ["p"], [4], 1)
    finally:
        sock.close()
    if error is None:
        assert r["completed"] == 1 and r["output_tokens"] == counted
    else:
        assert r["completed"] == 0 and r["failed"] == 1 and error in r["errors"][0]
