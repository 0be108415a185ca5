"""Owns running an ASGI app under a real uvicorn on 127.0.0.1 (a free port) in a thread, for tests."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Literal

import uvicorn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server started in another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_in_thread(app: Any, *, lifespan: Literal["auto", "on", "off"] = "auto", timeout: float = 60.0) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Start `app`; returns (base URL, server, thread) once it accepts connections.
    Stop it with `server.should_exit = True; thread.join()`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread
