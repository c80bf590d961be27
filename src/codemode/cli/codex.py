"""``codemode codex link DIR`` / ``codemode codex unlink DIR``: a Codex that runs cells here.

The Codex CLI runs its cells on the program ``codex-code-mode-host`` in the directory of its own
(canonical) executable; nothing else selects it. ``link`` builds a layout directory holding a
hard link to (or, across file systems, a copy of) the native ``codex`` executable and a
``codex-code-mode-host`` that starts this package's host (``codemode.cli.codex_host``).
``DIR/codex`` is then Codex as before, with cells served by codemode; the original installation
is not touched. ``unlink`` removes exactly what ``link`` made.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Final

__all__ = ["add_parser", "link", "unlink"]

#: The record ``link`` leaves in the layout (what to remove).
MARKER: Final = ".codemode-codex-layout.json"
HOST: Final = "codex-code-mode-host"
_ELF: Final = b"\x7fELF"


class LayoutError(Exception):
    """A layout cannot be made or removed; the message says why."""


def native_codex(path: str) -> Path:
    """The native executable behind ``path`` (a ``codex`` on PATH may be npm's JavaScript
    launcher, whose package holds the binary under ``vendor/<target>/bin/codex``)."""
    real = Path(os.path.realpath(path))
    if not real.is_file():
        raise LayoutError(f"{path}: no such file")
    with real.open("rb") as file:
        if file.read(4) == _ELF:
            return real
    package = real.parent.parent  # .../@openai/codex/bin/codex.js → .../@openai/codex
    patterns = (
        "vendor/*/bin/codex",
        "node_modules/@openai/codex-*/vendor/*/bin/codex",
        "../codex-*/vendor/*/bin/codex",
    )
    for pattern in patterns:
        for candidate in sorted(glob.glob(str(package / pattern))):
            with open(candidate, "rb") as file:
                if file.read(4) == _ELF:
                    return Path(os.path.realpath(candidate))
    raise LayoutError(
        f"{path} is not the native codex executable and its package holds none: give --codex "
        "the path of .../vendor/<target>/bin/codex"
    )


def link(directory: Path, codex: str, *, python: str = sys.executable) -> tuple[Path, str]:
    """Build the layout in ``directory``; returns ``DIR/codex`` and how it was made (``"hard
    link"`` or ``"copy"``)."""
    source = native_codex(codex)
    marker = directory / MARKER
    if directory.exists():
        if marker.exists():
            unlink(directory)  # a previous layout: rebuild it
        elif any(directory.iterdir()):
            raise LayoutError(f"{directory} exists and is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "codex"
    try:
        os.link(source, target)
        how = "hard link"
    except OSError:
        shutil.copy2(source, target)
        how = "copy"
    host = directory / HOST
    host.write_text(
        "#!/bin/sh\n"
        "# Made by `codemode codex link`: Codex's code-mode host, served by codemode.\n"
        f'exec {shlex.quote(python)} -m codemode.cli.codex_host "$@"\n'
    )
    host.chmod(0o755)
    marker.write_text(json.dumps({"codex": str(source), "files": ["codex", HOST]}, indent=2))
    return target, how


def unlink(directory: Path) -> None:
    """Remove what :func:`link` made in ``directory`` (and the directory, if then empty)."""
    marker = directory / MARKER
    try:
        record = json.loads(marker.read_text())
    except FileNotFoundError:
        raise LayoutError(f"{directory} is not a layout made by `codemode codex link`") from None
    for name in record.get("files", []):
        if name in ("codex", HOST):
            (directory / name).unlink(missing_ok=True)
    marker.unlink()
    if not any(directory.iterdir()):
        directory.rmdir()


def _link_command(args: argparse.Namespace) -> int:
    codex = args.codex or shutil.which("codex")
    if codex is None:
        print("codemode codex link: no codex on PATH: give --codex PATH", file=sys.stderr)
        return 2
    try:
        target, how = link(Path(args.directory), codex)
    except (LayoutError, OSError) as error:
        print(f"codemode codex link: {error}", file=sys.stderr)
        return 1
    print(f"{target} ({how} of {native_codex(codex)}) runs its cells on codemode")
    return 0


def _unlink_command(args: argparse.Namespace) -> int:
    try:
        unlink(Path(args.directory))
    except (LayoutError, OSError) as error:
        print(f"codemode codex unlink: {error}", file=sys.stderr)
        return 1
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``codex`` command."""
    codex = commands.add_parser(
        "codex",
        help="make a Codex CLI run its cells on codemode",
        description="Codex runs its code-mode cells on the program codex-code-mode-host next to "
        "its own executable. `link DIR` builds DIR/codex (a hard link to the native codex "
        "executable, or a copy across file systems) beside a codex-code-mode-host that starts "
        "codemode's host; run DIR/codex instead of codex. The original installation is not "
        "modified. `unlink DIR` removes what link made.",
    )
    actions = codex.add_subparsers(dest="action", required=True, metavar="ACTION")
    make = actions.add_parser("link", help="build a layout directory")
    make.add_argument("directory", metavar="DIR")
    make.add_argument(
        "--codex",
        metavar="PATH",
        help="the codex executable (default: codex on PATH; npm's launcher is followed to its "
        "native binary)",
    )
    make.set_defaults(handler=_link_command)
    remove = actions.add_parser("unlink", help="remove a layout directory made by link")
    remove.add_argument("directory", metavar="DIR")
    remove.set_defaults(handler=_unlink_command)
