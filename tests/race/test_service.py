"""The passcode service: hashed storage, constant-time compare, body and attempt limits, no
passcode in the logs, and a loopback load that catches the buggy variant only."""

from __future__ import annotations

import http.client
import json
import logging
import threading

import pytest

from isolab.race.service import Digest, Hasher, loopback_load, make_server


def test_digest_equality_is_by_value() -> None:
    assert Digest(b"abc") == Digest(b"abc") and Digest(b"abc") != Digest(b"abd")
    assert Digest(b"abc") != "abc"


def test_hasher_is_salted() -> None:
    a, b = Hasher(b"salt-one-16bytes", n=2), Hasher(b"salt-two-16bytes", n=2)
    assert a.digest("x") == a.digest("x") and a.digest("x") != b.digest("x")


@pytest.fixture()
def server():
    srv = make_server("lock_local", "hunter2-secret", port=0, max_attempts=3, window=60, scrypt_n=2)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _post(port: int, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/check", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, payload


def test_service_checks_limits_and_never_logs_the_passcode(server: int, caplog) -> None:
    caplog.set_level(logging.INFO, logger="isolab.passcode")
    assert _post(server, json.dumps({"passcode": "hunter2-secret"}).encode()) == (200, {"accepted": True})
    assert _post(server, json.dumps({"passcode": "wrong-guess"}).encode()) == (200, {"accepted": False})
    assert _post(server, b"not json")[0] == 400
    assert _post(server, json.dumps({"passcode": "x"}).encode())[0] == 429  # 4th attempt in the window
    assert _post(server, b"x" * 5000)[0] == 413
    logged = caplog.text
    assert "accepted=True" in logged
    assert "hunter2" not in logged and "wrong-guess" not in logged


def test_the_wrong_method_is_a_405_naming_the_right_one_and_a_429_says_when(server: int) -> None:
    """GET /check was a 404 (as if the path did not exist); a 429 carried no Retry-After."""
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
    conn.request("GET", "/healthz?probe=1")  # a query string does not change the route
    assert conn.getresponse().status == 200
    conn.close()
    for method, path, allow in (("GET", "/check", "POST"), ("POST", "/healthz?x=1", "GET")):
        conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
        conn.request(method, path, b"{}" if method == "POST" else None)
        resp = conn.getresponse()
        assert resp.status == 405 and resp.getheader("Allow") == allow and allow in json.loads(resp.read())["error"]
        conn.close()
    for _ in range(3):
        _post(server, json.dumps({"passcode": "x"}).encode())
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
    conn.request("POST", "/check", json.dumps({"passcode": "x"}).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 429 and 1 <= int(resp.getheader("Retry-After")) <= 60
    conn.close()


def test_loopback_load_catches_the_buggy_variant_only() -> None:
    runs = []
    for _ in range(3):  # probabilistic: retry a bounded number of times, stop at the first catch
        runs.append(loopback_load("buggy", clients=8, requests=6000, stop_at_first=True))
        if runs[-1].false_accepts:
            break
    assert runs[-1].false_accepts > 0, runs
    fixed = loopback_load("lock_local", clients=8, requests=2000)
    assert fixed.requests == 2000 and (fixed.false_accepts, fixed.false_rejects) == (0, 0)
