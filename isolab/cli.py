"""Owns the `isolab` command line: one subcommand per module, each registered by `register()`.

Every subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Errors that a user can cause (IsolabError) become one sentence on stderr
and exit code 2; nothing prints a stack trace unless ISOLAB_DEBUG=1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from isolab.errors import IsolabError

# Modules that add subcommands, in the order `isolab --help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "isolab.commands.generate",
    "isolab.commands.serve",
    "isolab.commands.bench",
    "isolab.commands.selftest",
    "isolab.commands.probe",
    "isolab.commands.doctor",
    "isolab.commands.lifecycle",
    "isolab.commands.race",
    "isolab.commands.cache",
)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser (add_parser makes its children of this class): remembers the last one
    that parsed, so an unknown argument is refused with that command's usage, not the top level's
    (`isolab generate Hi --bogus` printed `usage: isolab [-h] COMMAND ...`)."""

    last: argparse.ArgumentParser | None = None

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        _Parser.last = self
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="isolab",
        description="An LLM engine whose shared KV cache is isolated by construction, and the lab that proves it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # not written yet: the command simply does not exist
                continue
            raise
        module.register(sub)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Refuse prefixes of long options everywhere: `bench --output F` must not mean --output-len F."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def main(argv: Sequence[str] | None = None) -> int:
    # Model output on a terminal or pipe that cannot encode it (PYTHONIOENCODING=ascii, a C locale):
    # a '?' in its place, not a UnicodeEncodeError after the work is done.
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the command that was parsing them (exit 2, as parse_args does)
        words = list(sys.argv[1:] if argv is None else argv)
        before = args.command in words and unknown[0] in words and words.index(unknown[0]) < words.index(args.command)
        (parser if before else _Parser.last or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    empty = _empty_option(list(sys.argv[1:] if argv is None else argv), args)
    if empty is not None:  # (an unset $URL ran the engine in-process; --json "" wrote nothing, exit 0)
        (_Parser.last or parser).error(f"{empty} is empty: give {EMPTY_REFUSED[empty]}")
    return guarded(lambda: int(args.func(args) or 0))


# options whose value names a file or a server: an empty one is a mistake (an unset variable), not "not given"
EMPTY_REFUSED = {"--json": "a file name", "--trace": "a file name", "--url": "the server's URL",
                 "--base-url": "the server's URL"}


def _empty_option(words: list[str], args: argparse.Namespace) -> str | None:
    """The first of EMPTY_REFUSED given an empty value (`--json ""` or `--json=`), where it takes one."""
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name not in EMPTY_REFUSED or isinstance(getattr(args, name[2:].replace("-", "_"), None), bool):
            continue
        if (eq and value == "") or (not eq and i + 1 < len(words) and words[i + 1] == ""):
            return name
    return None


def guarded(run: Callable[[], int]) -> int:
    """run() as a command: an IsolabError, or a file the system refused after the command's own checks
    (a write into /proc, say), is one sentence and exit 2; a closed pipe and Ctrl-C end quietly."""
    if sys.stdout is None:  # started with its standard output closed (`>&-`): print() would fail deep inside
        print("isolab: error: standard output is closed: give it somewhere to write (a file, /dev/null)", file=sys.stderr)
        return 2
    try:
        code = run()
        sys.stdout.flush()  # a full disk or a bad descriptor shows here, not as a traceback at exit
        return code
    except IsolabError as exc:
        if os.environ.get("ISOLAB_DEBUG"):
            raise
        print(f"isolab: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`isolab ... | head`): stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        if os.environ.get("ISOLAB_DEBUG"):
            raise
        if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EBADF, errno.EIO, errno.EDQUOT):
            print(f"isolab: error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
            with contextlib.suppress(OSError):  # (what is left in the buffer would fail again at exit)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 2
        if exc.filename is None:
            raise
        print(f"isolab: error: cannot use {str(exc.filename)!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("isolab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
