"""Owns `isolab cache`: what isolab keeps on disk between runs (~/.cache/isolab, or wherever the
environment moves each kind), how big it is, and removing it.

    isolab cache [list] [KIND ...] [--json]   each kind: its folder, entries, size; stale entries named
    isolab cache clear [KIND ...] [--stale]   remove entries: every kind, or the kinds named;
                                              --stale: only what this isolab no longer reads

Every kind is rebuilt on the next run that needs it, so clearing loses nothing but time: the
kernels compile again (a minute), the invariance check runs again (seconds), the tokenizer and the
packed weights are rebuilt from the GGUF (seconds), Gemma 3's file is joined again from its pip
packages. Only names a kind writes are listed or removed (the folder may be one the user shares
with other things, through ISOLAB_WEIGHT_CACHE or ISOLAB_CACHE). A server that maps a removed file
keeps its pages (an unlinked file lives while it is mapped or loaded).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    root: Callable[[], Path | None]  # None: this kind is off
    entry: re.Pattern[str]  # the names this kind writes in its folder (temporaries included)
    stale: Callable[[Path], str | None] = lambda path: None  # why nothing reads an entry any more; None: in use


def _weights_root() -> Path | None:
    from isolab.models.weight_cache import cache_root

    return cache_root()


OLDER = "an older isolab's"
KILLED = "a killed writer's temporary"


def _weights_stale(path: Path) -> str | None:
    """A folder of other packing code than this isolab's (weight_cache.code_key)."""
    from isolab.models.weight_cache import code_key

    key = code_key()
    return OLDER if key is None or not path.name.endswith("-" + key) else None


def _temporary(path: Path) -> str | None:
    """A writer's temporary (NAME.PID.tmp, or a kernel build's folder) untouched for 10 minutes: left
    by a process killed while writing (a younger one may be being written now)."""
    try:
        old = time.time() - path.stat().st_mtime > 600
    except OSError:
        return None
    return KILLED if old and (path.name.endswith(".tmp") or path.is_dir()) else None


def _kernels_stale(path: Path) -> str | None:
    """A build of other sources or another compiler than any ISA level of this isolab's, or a killed
    build's folder; nothing is stale where no compiler says what the current builds are."""
    if path.is_dir():
        return _temporary(path)
    current = _current_kernels()
    return OLDER if current is not None and path.name not in current else None


@functools.cache
def _current_kernels() -> frozenset[str] | None:
    from isolab import kernels

    try:
        return frozenset(kernels.build_target(isa=level)[0].name for level in (*kernels.isa_levels(), "native"))
    except (kernels.BuildError, OSError, subprocess.SubprocessError):
        return None  # no compiler: what is current is unknown, so nothing is called stale


def _kernels_root() -> Path:
    from isolab import kernels

    return kernels.cache_root()


def _invariance_root() -> Path:
    from isolab.models import invariance

    return invariance.cache_root()


def _tokenizers_root() -> Path:
    from isolab.models import tokenizer

    return tokenizer.cache_root()


def _models_root() -> Path:
    from isolab.models import locate

    return locate.cache_root()


KINDS: tuple[Kind, ...] = (
    Kind("weights", "packed weights, mapped by every server of a GGUF", _weights_root,
         re.compile(r"[0-9a-f]{32}-[0-9a-f]{16}"), _weights_stale),
    Kind("kernels", "compiled native kernels, one per source, ISA level and compiler", _kernels_root,
         re.compile(r"isolab-kernels-[0-9a-f]+\.so|isolab-kernels-tmp-\w+"), _kernels_stale),
    Kind("invariance", "batch-invariance verdicts, one per CPU, kernel build and library", _invariance_root,
         re.compile(r"[0-9a-f]+\.json|[0-9a-f]+\.\d+\.tmp"), _temporary),
    Kind("tokenizers", "tokenizers built from a GGUF's vocabulary", _tokenizers_root, re.compile(r"[0-9a-f]{32}")),
    Kind("models", "model files joined from pip packages (Gemma 3)", _models_root,
         re.compile(r"[\w.-]+\.gguf|[\w.-]+\.\d+\.tmp"), _temporary),
)


@dataclass(frozen=True)
class Entry:
    kind: str
    path: Path
    bytes: int
    stale: str | None  # why nothing reads it any more (OLDER, KILLED); None: in use


def _size(path: Path) -> int:
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
        return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
    except OSError:
        return 0


def entries(kind: Kind) -> list[Entry]:
    """The entries of one kind, by name; none where its folder is missing or the kind is off."""
    root = kind.root()
    if root is None or not root.is_dir():
        return []
    out = []
    for path in sorted(root.iterdir()):
        if kind.entry.fullmatch(path.name):
            out.append(Entry(kind.name, path, _size(path), kind.stale(path)))
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for p in path.rglob("*"):  # cached files are read-only; their folders are not
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="list or clear what isolab keeps on disk (packed weights, kernels, ...)",
                       description="List or clear what isolab keeps on disk between runs: packed weights, compiled "
                                   "kernels, invariance verdicts, tokenizers, joined model files. Each is rebuilt "
                                   "on the next run that needs it; clearing costs only time.")
    p.add_argument("words", nargs="*", metavar="[list|clear] KIND",
                   help=f"list (the default) or clear; then any of {', '.join(k.name for k in KINDS)} "
                        "(default: every kind)")
    p.add_argument("--stale", action="store_true", help="with clear: only the entries this isolab no longer reads")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from isolab.errors import InvalidRequestError

    names = {k.name: k for k in KINDS}
    words = list(args.words)
    action = words.pop(0) if words and words[0] in ("list", "clear") else "list"
    unknown = [n for n in words if n not in names]
    if unknown:
        raise InvalidRequestError(f"no cache kind {unknown[0]!r}: choose from {', '.join(names)}", field="kinds")
    if action == "list" and args.stale:
        raise InvalidRequestError("--stale goes with `isolab cache clear`", field="stale")
    chosen = [names[n] for n in dict.fromkeys(words)] or list(KINDS)  # a kind named twice counts once
    if action == "clear":
        return _clear(chosen, args.stale, args.json)
    report = [_report(kind) for kind in chosen]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in report], indent=1))
        return 0
    for r in report:
        count = f"{r.entries} {'entry' if r.entries == 1 else 'entries'}"
        print(f"{r.kind:<11} {count:>11} {_mib(r.bytes):>12}  {r.folder or 'off'}")
        print(f"{'':<11} {r.what}")
        for st in r.stale:
            print(f"{'':<11} stale ({st.why}): {st.name} {_mib(st.bytes)}")
    total = sum(r.bytes for r in report)
    stale = sum(st.bytes for r in report for st in r.stale)
    print(f"in all {_mib(total)}" + (f", {_mib(stale)} of it stale: `isolab cache clear --stale` removes it" if stale else ""))
    return 0


@dataclass(frozen=True)
class StaleEntry:
    name: str
    bytes: int
    why: str


@dataclass(frozen=True)
class KindReport:
    kind: str
    what: str
    folder: str | None  # None: the kind is off
    entries: int
    bytes: int
    stale: list[StaleEntry]


def _report(kind: Kind) -> KindReport:
    root, found = kind.root(), entries(kind)
    return KindReport(kind.name, kind.what, None if root is None else str(root), len(found), sum(e.bytes for e in found),
                      [StaleEntry(e.path.name, e.bytes, e.stale) for e in found if e.stale])


def _clear(chosen: list[Kind], stale_only: bool, as_json: bool) -> int:
    removed: list[Entry] = []
    failed: list[tuple[Entry, OSError]] = []
    for kind in chosen:
        for e in entries(kind):
            if stale_only and not e.stale:
                continue
            try:
                _remove(e.path)
                removed.append(e)
            except OSError as err:
                failed.append((e, err))
    freed = sum(e.bytes for e in removed)
    if as_json:
        print(json.dumps({"removed": [str(e.path) for e in removed], "bytes": freed,
                          "failed": [{"path": str(e.path), "error": str(err)} for e, err in failed]}, indent=1))
    else:
        print(f"removed {len(removed)} {'entry' if len(removed) == 1 else 'entries'}, {_mib(freed)}")
        for e, why in failed:
            print(f"could not remove {e.path}: {why.strerror or why}")
    return 1 if failed else 0
