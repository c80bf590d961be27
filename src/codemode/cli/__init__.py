"""The ``codemode`` command line: one module per command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


class _Version(argparse.Action):
    """``--version``, looked up only when asked (``importlib.metadata`` is slow to import)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"codemode {_version()}")
        parser.exit()


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``only`` builds just that command (and imports just its module)."""
    from importlib import import_module

    parser = argparse.ArgumentParser(
        prog="codemode",
        description="Code Mode protocol tools: run cells, serve hosts, check wire data.",
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in (only,) if only else _COMMANDS:
        import_module(f"codemode.cli.{name}").add_parser(commands)
    return parser


_COMMANDS = ("run", "host", "doctor", "wire", "codex")


def _named_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names first, if any: only its module then needs importing (a host's
    start-up pays for no other command's imports)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in _COMMANDS else None
    return None


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("codemode")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        from codemode import __version__

        return __version__


def _standard_streams() -> None:
    """Make descriptors 0, 1 and 2 usable, for a command started with one of them closed
    (``codemode run cell.js <&-``): each closed one is opened on /dev/null, so that no pipe or
    file opened later takes its number (uvloop aborts on closing such a pipe; output would reach
    it), and a standard stream Python left None (it had no descriptor) is opened on it."""
    while (fd := os.open(os.devnull, os.O_RDWR)) <= 2:
        pass  # the lowest free number: it was closed, /dev/null now fills it
    os.close(fd)
    for name, number, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(number, mode, encoding="utf-8", closefd=False))  # noqa: SIM115


def main(argv: Sequence[str] | None = None, *, only: str | None = None) -> int:
    """Run the command line; returns the exit status. ``only`` names the one command ``argv``
    may use (the others are then not imported)."""
    _standard_streams()
    if argv is None:
        argv = sys.argv[1:]
    args = _parser(only or _named_command(argv)).parse_args(argv)
    try:
        status: int = args.handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`codemode wire frames capture.bin | head`): not an error of ours.
        # Point stdout at /dev/null so that the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
