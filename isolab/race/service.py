"""Owns the passcode service: a threaded HTTP server (the seed's "service") that checks a posted
passcode with a chosen checker variant, and the loopback load test that drives it.

The passcode is never kept or logged as text: the server keeps a salted scrypt hash, hashes each
candidate with the same salt, and the checker compares the two digests in constant time (the
digests are `Digest`s, whose `==` is hmac.compare_digest, so the seed's `==` code is unchanged).
Bodies over MAX_BODY bytes get 413; more than `max_attempts` per client per window get 429.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from isolab.errors import InvalidRequestError
from isolab.race.checkers import get_variant

MAX_BODY = 1024  # bytes: a passcode field needs far less
MAX_WINDOW_S = 86400.0
READ_TIMEOUT_S = 10.0  # a request's line, headers and body each arrive within this, or the connection ends
log = logging.getLogger("isolab.passcode")


class Digest(bytes):
    """A hash value whose equality takes the same time whatever the bytes."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, bytes) and hmac.compare_digest(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = bytes.__hash__


@dataclass(frozen=True)
class Hasher:
    salt: bytes
    n: int = 2**14  # scrypt cost; r=8, p=1 as RFC 7914 recommends

    def __post_init__(self) -> None:
        if self.n < 2 or self.n & (self.n - 1):
            raise InvalidRequestError("scrypt n must be a power of two >= 2", field="scrypt_n")

    def digest(self, passcode: str) -> Digest:
        return Digest(hashlib.scrypt(passcode.encode(), salt=self.salt, n=self.n, r=8, p=1, dklen=32))


ROUTES = {"/check": "POST", "/healthz": "GET"}  # path -> the method it takes


class RateLimiter:
    """At most `max_attempts` per client in any `window` seconds (0 attempts = no limit)."""

    def __init__(self, max_attempts: int, window: float) -> None:
        self.max_attempts = max_attempts
        self.window = window
        self.lock = threading.Lock()
        self.seen: dict[str, deque[float]] = {}

    def allow(self, client: str) -> bool:
        return self.wait(client) == 0.0

    def wait(self, client: str) -> float:
        """0.0, counting this attempt, if the client may try now; else the seconds until its oldest
        attempt leaves the window (not counted)."""
        if self.max_attempts <= 0:
            return 0.0
        now = time.monotonic()
        with self.lock:
            q = self.seen.setdefault(client, deque())
            while q and now - q[0] > self.window:
                q.popleft()
            if len(q) >= self.max_attempts:
                return max(self.window - (now - q[0]), 1e-3)
            q.append(now)
            return 0.0


def check_settings(port: int, max_attempts: int, window: float) -> None:
    """The service's numbers, refused with a sentence when they make no sense: a TCP port (0: any free
    one), attempts per window (0: no limit), and a window of positive, finite seconds."""
    if not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be between 0 and 65535 (0: any free port), not {port}", field="port")
    if max_attempts < 0:
        raise InvalidRequestError(f"--max-attempts must be 0 (no limit) or more, not {max_attempts}",
                                  field="max_attempts")
    if not (math.isfinite(window) and 0 < window <= MAX_WINDOW_S):  # (1e300 sent a 301-digit Retry-After)
        raise InvalidRequestError(f"--window must be a positive number of seconds, at most {MAX_WINDOW_S:g} "
                                  f"(a day), not {window}", field="window")


def make_server(variant: str, passcode: str, host: str = "127.0.0.1", port: int = 0, max_attempts: int = 10,
                window: float = 60.0, scrypt_n: int = 2**14) -> ThreadingHTTPServer:
    check_settings(port, max_attempts, window)
    spec = get_variant(variant)
    hasher = Hasher(secrets.token_bytes(16), scrypt_n)
    try:
        secret = hasher.digest(passcode)
    except (ValueError, MemoryError) as exc:  # OpenSSL's scrypt refuses a cost whose memory is over its limit
        raise InvalidRequestError(f"--scrypt-n {scrypt_n} is too costly for scrypt ({exc}): try 16384 (2**14)",
                                  field="scrypt_n") from None
    checker = spec.factory(cast(Any, secret))  # the checker never sees the passcode text
    limiter = RateLimiter(max_attempts, window)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # header and body go out in two writes: no 40 ms delayed-ACK stall
        timeout = READ_TIMEOUT_S  # a client that sends part of a request and waits held a thread forever

        # What is logged: the client, a known route or "other", the status. Never a request line, a path
        # or a body: a body left unread on a kept-alive connection was read as the next request line, and
        # the standard handler logged it ("Bad HTTP/0.9 request type ('{"passcode":')"), passcode and all.
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            route = getattr(self, "path", "").split("?", 1)[0]
            route = route if route in ROUTES else "other"
            log.info("%s %s %s %s", self.client_address[0], getattr(self, "command", None) or "-", route, code)

        def log_error(self, format: str, *args: object) -> None:  # noqa: A002 (the standard name)
            log.info("%s malformed or timed-out request", self.client_address[0])

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.info("%s request", self.client_address[0])

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The standard handler's own refusals (a malformed request line, a method it has no do_ for)
            as JSON like every other reply, on a connection closed after it."""
            self.close_connection = True
            self.request_version = self.protocol_version  # (a garbled line reads as HTTP/0.9: no status line)
            # the status's own phrase: the standard message quotes the request line back
            self._reply(code, {"error": HTTPStatus(code).phrase}, {"Connection": "close"})

        def _reply(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _refuse_unread(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            """A refusal before the body is read: the connection closes after it, so the body is never
            read as a request of its own (and logged)."""
            self.close_connection = True
            self._reply(status, payload, {**(headers or {}), "Connection": "close"})

        def _elsewhere(self, method: str) -> None:
            """A path we serve with another method (405 naming it), or one we do not serve (404)."""
            route = self.path.split("?", 1)[0]
            allowed = ROUTES.get(route)
            if allowed is not None and allowed != method:
                self._refuse_unread(405, {"error": f"{method} is not allowed on {route}: use {allowed}"},
                                    {"Allow": allowed})
            else:
                self._refuse_unread(404, {"error": "not found"})

        def do_PUT(self) -> None:
            self._elsewhere("PUT")

        def do_DELETE(self) -> None:
            self._elsewhere("DELETE")

        def do_PATCH(self) -> None:
            self._elsewhere("PATCH")

        def do_HEAD(self) -> None:
            self._elsewhere("HEAD")

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] == "/healthz":
                self._reply(200, {"ok": True, "variant": spec.name})
            else:
                self._elsewhere("GET")

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != "/check":
                self._elsewhere("POST")
                return
            given = self.headers.get("Content-Length")
            try:
                length = int(given) if given is not None else -1
            except ValueError:
                length = -2
            if length < 0:  # none: 411; one that is no length ("abc", "-5"): 400
                status = 411 if given is None else 400
                self._refuse_unread(status, {"error": "Content-Length required" if given is None else
                                             "Content-Length is not a length"})
                return
            if length > MAX_BODY:
                self._refuse_unread(413, {"error": f"body over {MAX_BODY} bytes"})
                return
            try:
                raw = self.rfile.read(length)
            except OSError:  # (TimeoutError: a body that never came in READ_TIMEOUT_S; a client gone)
                self.close_connection = True
                return
            if len(raw) < length:  # the client closed before its whole body
                self.close_connection = True
                return
            wait = limiter.wait(self.client_address[0])
            if wait:
                self._reply(429, {"error": "too many attempts"}, {"Retry-After": str(math.ceil(wait))})
                return
            try:
                candidate = json.loads(raw)["passcode"]
                if not isinstance(candidate, str):
                    raise TypeError
                candidate.encode()  # "\ud800" (half of an escaped pair) is JSON but no text: 400, not a dropped connection
            except (ValueError, KeyError, TypeError):
                self._reply(400, {"error": 'body must be {"passcode": "<string>"}'})
                return
            accepted = bool(checker.check(cast(Any, hasher.digest(candidate))))
            log.info("%s check accepted=%s", self.client_address[0], accepted)
            self._reply(200, {"accepted": accepted})

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            # a client that hangs up mid-reply: one line, not socketserver's traceback on stderr
            kind = sys.exc_info()[0]
            log.info("%s connection ended: %s", client_address[0], kind.__name__ if kind is not None else "?")

    try:
        server = Server((host, port), Handler)
    except OSError as exc:  # in use, not this machine's address, a port below 1024 without the right
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="port") from None
    server.daemon_threads = True
    return server


def serve_forever(variant: str, host: str, port: int, max_attempts: int, window: float, scrypt_n: int,
                  quiet: bool = False) -> int:
    check_settings(port, max_attempts, window)
    passcode = os.environ.get("ISOLAB_PASSCODE")
    if not passcode or not passcode.strip():  # (spaces were taken as the passcode)
        raise InvalidRequestError("set ISOLAB_PASSCODE to the passcode the service should accept (not empty, "
                                  "not only spaces)")
    if not host.strip():  # ("" listened on every interface, and the banner said http://:PORT)
        raise InvalidRequestError("--host is empty: give an address (127.0.0.1, or 0.0.0.0 for every interface)",
                                  field="host")
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = make_server(variant, passcode, host, port, max_attempts, window, scrypt_n)
    print(f"passcode service ({variant}) on http://{host}:{server.server_address[1]}  POST /check", file=sys.stderr)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


@dataclass(frozen=True)
class LoadResult:
    variant: str
    requests: int
    false_accepts: int
    false_rejects: int
    seconds: float


def loopback_load(variant: str, clients: int = 8, requests: int = 2000, scrypt_n: int = 2,
                  switch_interval: float | None = 1e-5, stop_at_first: bool = False) -> LoadResult:
    """Runs a server on 127.0.0.1 and `clients` keep-alive connections, half right, half wrong.
    scrypt_n=2 keeps hashing cheap so that the check, not the hash, is what the load hits."""
    right, wrong = "lab-right-" + secrets.token_hex(4), "lab-wrong-" + secrets.token_hex(4)
    server = make_server(variant, right, port=0, max_attempts=0, scrypt_n=scrypt_n)
    port = server.server_address[1]
    serve = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serve.start()
    counts = [[0, 0] for _ in range(clients)]  # [accepts, sent]
    stop = threading.Event()
    barrier = threading.Barrier(clients)

    def client(i: int) -> None:
        body = json.dumps({"passcode": right if i % 2 == 0 else wrong}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        barrier.wait()
        for _ in range(requests // clients):
            if stop.is_set():
                break
            conn.request("POST", "/check", body, {"Content-Type": "application/json"})
            accepted = json.loads(conn.getresponse().read())["accepted"]
            counts[i][0] += accepted
            counts[i][1] += 1
            if stop_at_first and accepted and i % 2 == 1:  # the first false accept ends the run
                stop.set()
        conn.close()

    old = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    start = time.perf_counter()
    try:
        workers = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
        server.shutdown()
        server.server_close()
    seconds = time.perf_counter() - start
    sent = sum(c[1] for c in counts)
    false_accepts = sum(c[0] for i, c in enumerate(counts) if i % 2 == 1)
    false_rejects = sum(c[1] - c[0] for i, c in enumerate(counts) if i % 2 == 0)
    return LoadResult(variant, sent, false_accepts, false_rejects, seconds)
