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

    def _failed(self, exc: OSError) -> InvalidRequestError:
        """A write that failed (a full disk), named: the generic 'cannot write the output' said not which."""
        with contextlib.suppress(OSError):
            self._fh.close()  # (its buffer would fail again at exit)
        return InvalidRequestError(f"cannot write the trace {self.path!r} ({exc.strerror or exc})", field="trace_path")

    def set_step(self, step: int) -> None:
        self.step = step

    def emit(self, kind: str, block_id: int, request_id: str | None, scope: str | None, **extra: object) -> None:
        assert kind in EVENT_KINDS, kind
        rec = {"step": self.step, "event": kind, "block": block_id, "request": request_id, "scope": scope}
        rec.update(extra)
        try:
            self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except OSError as exc:
            raise self._failed(exc) from None
        except ValueError:  # closed after a failed write: the error was raised then
            if not self._fh.closed:
                raise

    def flush(self) -> None:
        """Hand what is written to the OS (after each step and abort): a reader sees an idle engine's
        whole trace, and a process that dies loses at most the step it was in."""
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
