"""The ``codemode`` command line: one module per command."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence

from codemode.cli import codex, doctor, host, run, wire

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codemode",
        description="Code Mode protocol tools: run cells, serve hosts, check wire data.",
    )
    parser.add_argument("--version", action="version", version=f"codemode {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (run, host, doctor, wire, codex):
        command.add_parser(commands)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("codemode")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        from codemode import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
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
