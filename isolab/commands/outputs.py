"""Owns the check of a file a command will write at its end (--json, --plot, --out, --trace, --report):
done before the work, so a path that cannot be written is one sentence at once, not a stack trace
after minutes of work."""

from __future__ import annotations

import os
from pathlib import Path

from isolab.errors import InvalidRequestError


def check_output_path(path: str | os.PathLike[str] | None, option: str, *, folder: bool = False) -> None:
    """Refuse (InvalidRequestError naming `option`) a path this process cannot create or overwrite:
    a missing or unwritable parent folder, a folder where a file goes (or a file where a folder goes,
    with folder=True). Nothing is created. None: no output asked for."""
    if path is None or str(path) in ("", "-"):
        return
    p = Path(path)
    if folder:
        if p.exists() and not p.is_dir():
            raise InvalidRequestError(f"{option} {str(p)!r} is a file; name a folder", field=option)
        target = p if p.exists() else p.parent
    else:
        if p.is_dir():
            raise InvalidRequestError(f"{option} {str(p)!r} is a folder; name a file", field=option)
        if p.exists() and not os.access(p, os.W_OK):
            raise InvalidRequestError(f"{option} {str(p)!r} cannot be written (no permission)", field=option)
        target = p.parent
    target = target if str(target) else Path(".")
    if not target.is_dir():
        raise InvalidRequestError(f"{option} {str(p)!r}: the folder {str(target)!r} does not exist", field=option)
    if not os.access(target, os.W_OK | os.X_OK):
        raise InvalidRequestError(f"{option} {str(p)!r}: the folder {str(target)!r} cannot be written", field=option)
