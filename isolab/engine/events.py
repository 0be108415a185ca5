"""Owns the block lifecycle trace: one JSON line per block event, never token contents.

Events: allocated, written, sealed, hit, released, freed, evicted, poisoned, violation.
Off by default (NullSink); `EngineConfig.trace_path` turns on a JsonlSink.
"""

from __future__ import annotations

import contextlib
import json
from typing import IO, Protocol

from isolab.errors import InvalidRequestError

EVENT_KINDS = ("allocated", "written", "sealed", "hit", "released", "freed", "evicted", "poisoned", "violation")


class EventSink(Protocol):
    def emit(self, kind: str, block_id: int, request_id: str | None, scope: str | None, **extra: object) -> None: ...

    def set_step(self, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def emit(self, kind: str, block_id: int, request_id: str | None, scope: str | None, **extra: object) -> None:
        return None

    def set_step(self, step: int) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class JsonlSink:
    def __init__(self, path: str) -> None:
        try:
            self._fh: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise InvalidRequestError(f"cannot write the trace {path!r} ({exc.strerror or exc})",
                                      field="trace_path") from None
        self.path = path
        self.step = 0
        self.error: InvalidRequestError | None = None  # once a write failed: raised again by every later one

    def _failed(self, exc: OSError) -> InvalidRequestError:
        """A write that failed (a full disk), named: the generic 'cannot write the output' said not which.
        It stays failed: a trace with a hole in it would pass for the whole record (a server's steps then
        fail, each saying why, rather than serve on with an audit trail that silently stops)."""
        with contextlib.suppress(OSError):
            self._fh.close()  # (its buffer would fail again at exit)
        self.error = InvalidRequestError(f"cannot write the trace {self.path!r} ({exc.strerror or exc})",
                                         field="trace_path")
        return self.error

    def set_step(self, step: int) -> None:
        self.step = step

    def emit(self, kind: str, block_id: int, request_id: str | None, scope: str | None, **extra: object) -> None:
        assert kind in EVENT_KINDS, kind
        rec = {"step": self.step, "event": kind, "block": block_id, "request": request_id, "scope": scope}
        rec.update(extra)
        if self.error is not None:
            raise self.error
        try:
            self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        """Hand what is written to the OS (after each step and abort): a reader sees an idle engine's
        whole trace, and a process that dies loses at most the step it was in."""
        if self.error is not None:
            raise self.error
        if not self._fh.closed:
            try:
                self._fh.flush()
            except OSError as exc:
                raise self._failed(exc) from None

    def close(self) -> None:
        if not self._fh.closed:
            try:
                self._fh.close()
            except OSError as exc:
                raise self._failed(exc) from None
