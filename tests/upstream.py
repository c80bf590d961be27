"""The upstream host binary as a test oracle (``runtime.md``, Conventions, "Oracle").

:func:`upstream_host` fetches ``codex-code-mode-host`` from the npm package
``@openai/codex@VERSION-linux-x64`` the first time a test asks for it (never at import), checks the
tarball against its pinned npm integrity, unpacks only the host binary (and the package's other
binaries used here, while the tarball is at hand) into a cache directory and returns its path.
:func:`upstream_codex` does the same for the ``codex`` CLI of that package. Every failure (no npm,
no network, wrong platform, integrity mismatch) returns ``None`` and leaves the reason in
:func:`unavailable_reason`, so the tests that need the binary skip with it. A file lock makes
parallel callers (pytest-xdist workers, several runs) fetch once.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Final

from codemode.runtime.npm import (
    PackageFetchError,
    cache_dir,
    fetch_lock,
    npm_command,
    pack_verified,
)

__all__ = [
    "DEFAULT_VERSION",
    "INTEGRITY",
    "LATEST_VERSION",
    "unavailable_reason",
    "upstream_cache_dir",
    "upstream_codex",
    "upstream_host",
]

#: The upstream release the suite is checked against.
DEFAULT_VERSION: Final = "0.149.0"
#: The latest upstream release checked (the ``latest`` wire revision, ``docs/interop.md``).
LATEST_VERSION: Final = "0.171.0"
#: npm integrity (sha512 of the tarball) of each pinned release.
INTEGRITY: Final = {
    "0.149.0": "sha512-uZXaN9JPxu0/jjnqqJeTd4kRYPnjVZK3MiVndfG1mHhEaoDKL7ScWHfPqvAEOjwsSDEmQSlMfUkmvYp/CHciYw==",
    "0.171.0": "sha512-l66NZkQgdk2C3pbcfULDz42yEUB581MVA6I+Y43Wp4OIqEy73HCdmZ0GTjeAHY2ycuH4N00d9VsLrwT1jxshTw==",
}
#: Where the binaries sit inside the package tarball.
MEMBER: Final = "package/vendor/x86_64-unknown-linux-musl/bin/codex-code-mode-host"
BINARY: Final = "codex-code-mode-host"
CODEX_MEMBER: Final = "package/vendor/x86_64-unknown-linux-musl/bin/codex"
CODEX: Final = "codex"
_MEMBERS: Final = {BINARY: MEMBER, CODEX: CODEX_MEMBER}

_reasons: dict[str, str] = {}
_found: dict[str, Path] = {}


def upstream_cache_dir(version: str = DEFAULT_VERSION) -> Path:
    """``upstream/VERSION`` in codemode's package cache (``codemode.runtime.npm.cache_dir``)."""
    return cache_dir() / "upstream" / version


def unavailable_reason(version: str = DEFAULT_VERSION, binary: str = BINARY) -> str:
    """Why :func:`upstream_host` (or :func:`upstream_codex`, ``binary="codex"``) returned ``None``
    for ``version`` (empty if it did not)."""
    return _reasons.get(_key(version, binary), "")


def upstream_host(version: str = DEFAULT_VERSION) -> Path | None:
    """The path of the verified upstream host binary of ``version``, fetched once; else ``None``."""
    return _binary(version, BINARY)


def upstream_codex(version: str = DEFAULT_VERSION) -> Path | None:
    """The path of the verified ``codex`` CLI of ``version``, fetched once; else ``None``."""
    return _binary(version, CODEX)


def _key(version: str, binary: str) -> str:
    return version if binary == BINARY else f"{binary}@{version}"


def _binary(version: str, binary: str) -> Path | None:
    key = _key(version, binary)
    if key in _found:
        return _found[key]
    if key in _reasons:
        return None
    try:
        path = _ensure(version, binary)
    except _Unavailable as error:
        what = "upstream host" if binary == BINARY else f"upstream {binary}"
        _reasons[key] = f"{what} {version} unavailable: {error}"
        return None
    _found[key] = path
    return path


class _Unavailable(Exception):
    pass


def _ensure(version: str, binary: str = BINARY) -> Path:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        raise _Unavailable(
            f"the binary is for linux x86_64, this is {sys.platform} {platform.machine()}"
        )
    integrity = INTEGRITY.get(version)
    if integrity is None:
        raise _Unavailable("no pinned npm integrity for this release")
    directory = upstream_cache_dir(version)
    target = directory / binary
    if _usable(target):
        return target
    try:
        with fetch_lock(directory):
            if not _usable(target):
                _fetch(version, integrity, directory, binary)
    except OSError as error:
        raise _Unavailable(f"cache directory {directory}: {error}") from None
    except PackageFetchError as error:
        raise _Unavailable(error.message) from None
    return target


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _npm() -> list[str]:
    return npm_command()


def _fetch(version: str, integrity: str, directory: Path, binary: str) -> None:
    """Fetch the package once and unpack ``binary``, and the other binaries of ``_MEMBERS`` not
    cached yet while the tarball is here (every test of a release needs the same one)."""
    package = f"@openai/codex@{version}-linux-x64"
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as scratch:
        tarball = pack_verified(_npm(), package, integrity, Path(scratch))
        wanted = {
            member: Path(scratch) / name
            for name, member in _MEMBERS.items()
            if name == binary or not _usable(directory / name)
        }
        staged = _extract_binaries(tarball, wanted)
        if _MEMBERS[binary] not in staged:
            raise _Unavailable(f"{_MEMBERS[binary]} not found in the tarball")
        for member in staged:
            wanted[member].chmod(0o755)
            os.replace(wanted[member], directory / wanted[member].name)


def _extract_binaries(tarball: Path, wanted: dict[str, Path]) -> set[str]:
    """Copy each regular-file member named in ``wanted`` to its path; nothing else is read. The
    members found; one that is there but not a regular file is an error."""
    found: set[str] = set()
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive:
            path = PurePosixPath(member.name)
            if path.is_absolute() or ".." in path.parts or str(path) not in wanted:
                continue
            if not member.isfile():
                raise _Unavailable(f"{path} in the tarball is not a regular file")
            source = archive.extractfile(member)
            if source is None:
                continue
            with source, open(wanted[str(path)], "wb") as sink:
                shutil.copyfileobj(source, sink)
            found.add(str(path))
            if len(found) == len(wanted):
                break
    return found
