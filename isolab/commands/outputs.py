"""Owns what a command writes besides its output: the check of a file it will write at its end
(--json, --plot, --out, --trace, --report), done before the work, so a path that cannot be written
is one sentence at once, not a stack trace after minutes of work; and the scratch folders it removes
however it ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from isolab.errors import InvalidRequestError


def check_output_path(path: str | os.PathLike[str] | None, option: str, *, folder: bool = False,
                      make_parents: bool = False, plot: bool = False) -> None:
    """Refuse (InvalidRequestError naming `option`) a path this process cannot create or overwrite:
    a missing or unwritable parent folder, a folder where a file goes (or a file where a folder goes,
    with folder=True). make_parents: the writer makes missing folders, so the topmost missing one must
    be creatable instead. plot: a file matplotlib can write (a known image suffix, or none: png).
    A folder it would write in is tried by making an empty file there and removing it (on a mount that
    forbids removal, that file stays); nothing else is created. None: no output asked for."""
    if path is None or str(path) in ("", "-"):
        return
    p = Path(path)
    if plot and p.suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if p.suffix.lower().lstrip(".") not in kinds:
            raise InvalidRequestError(f"{option} {str(p)!r}: name a .png file (or one of {', '.join(sorted(kinds))})",
                                      field=option)
    if make_parents and not p.parent.exists():
        top = p
        while not top.parent.exists() and top.parent != top.parent.parent:
            top = top.parent  # the topmost missing folder: the writer makes it in the nearest existing one
        return check_output_path(top, option, folder=True)
    if folder:
        if p.exists() and not p.is_dir():
            raise InvalidRequestError(f"{option} {str(p)!r} is a file; name a folder", field=option)
        target = p if p.exists() else p.parent
    else:
        if p.is_dir():
            raise InvalidRequestError(f"{option} {str(p)!r} is a folder; name a file", field=option)
        if p.exists() and not os.access(p, os.W_OK):
            raise InvalidRequestError(f"{option} {str(p)!r} cannot be written (no permission)", field=option)
        if p.exists():  # written in place (a file, a pipe: `--json >(jq .)` is /dev/fd/N): its folder is not asked
            return
        target = p.parent
    target = target if str(target) else Path(".")
    if not target.is_dir():
        what = "is a file, not a folder" if target.exists() else "does not exist"  # (a file said 'does not exist')
        raise InvalidRequestError(f"{option} {str(p)!r}: the folder {str(target)!r} {what}", field=option)
    if not os.access(target, os.W_OK | os.X_OK) or not _can_create_in(target):
        raise InvalidRequestError(f"{option} {str(p)!r}: the folder {str(target)!r} cannot be written", field=option)


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in `folder`, by making one and removing it: os.access says yes to
    root for folders nobody can write a file in (/proc, /sys, a read-only bind mount's own rules)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".isolab-write-check-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return True


@contextlib.contextmanager
def scratch_folders() -> Iterator[Callable[[], str]]:
    """Yields make() -> a new temporary folder (isolab-XXXX); every one made is removed when the block
    ends, however it ends: a return, an error, Ctrl-C, or SIGTERM (a `kill`, a CI timeout), which
    raises SystemExit in the main thread for the block's length so that the removal runs."""
    import shutil
    import signal
    import tempfile
    import threading

    made: list[str] = []

    def make() -> str:
        made.append(tempfile.mkdtemp(prefix="isolab-"))
        return made[-1]

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        yield make
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
