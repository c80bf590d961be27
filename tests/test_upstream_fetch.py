"""``tests/upstream.py``: fetch once, verify, unpack only the binaries used (no network here)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import platform
import sys
import tarfile
from pathlib import Path

import pytest

from tests import upstream


def _tarball(path: Path, *, binary: bytes = b"\x7fELF host") -> str:
    """Write a package tarball with the two binaries and a hostile member; its integrity."""
    with tarfile.open(path, "w:gz") as archive:
        for name, data in (
            (upstream.MEMBER, binary),
            ("package/vendor/x86_64-unknown-linux-musl/bin/codex", b"\x7fELF codex"),
            ("../escape", b"outside"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``npm`` that copies a prepared tarball into --pack-destination and logs each call."""
    source = tmp_path / "source.tgz"
    log = tmp_path / "npm.log"
    script = tmp_path / "npm.py"
    script.write_text(
        "import shutil, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "dest = sys.argv[sys.argv.index('--pack-destination') + 1]\n"
        f"shutil.copy({str(source)!r}, dest + '/openai-codex-0.149.0-linux-x64.tgz')\n"
    )
    monkeypatch.setattr(upstream, "_npm", lambda: [sys.executable, str(script)])
    monkeypatch.setattr(upstream, "_found", {})
    monkeypatch.setattr(upstream, "_reasons", {})
    monkeypatch.setenv("CODEMODE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    return source


def test_fetches_once_and_keeps_only_the_binaries_used(
    fake_npm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(upstream.INTEGRITY, "0.149.0", _tarball(fake_npm))
    path = upstream.upstream_host("0.149.0")
    assert path == tmp_path / "cache" / "upstream" / "0.149.0" / "codex-code-mode-host"
    assert path.read_bytes() == b"\x7fELF host" and os.access(path, os.X_OK)
    # The codex CLI came with it (the same tarball): its own first use fetches nothing.
    codex = path.parent / "codex"
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "codex", path.name]
    assert not (tmp_path / "cache" / "escape").exists()
    monkeypatch.setattr(upstream, "_found", {})  # a fresh process: the cache is reused
    assert upstream.upstream_host("0.149.0") == path
    assert upstream.upstream_codex("0.149.0") == codex
    assert codex.read_bytes() == b"\x7fELF codex" and os.access(codex, os.X_OK)
    calls = (tmp_path / "npm.log").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("pack @openai/codex@0.149.0-linux-x64")


def test_integrity_mismatch_is_unavailable(fake_npm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tarball(fake_npm)
    monkeypatch.setitem(upstream.INTEGRITY, "0.149.0", "sha512-AAAA")
    assert upstream.upstream_host("0.149.0") is None
    assert "failed its integrity check" in upstream.unavailable_reason("0.149.0")
    assert not (upstream.upstream_cache_dir("0.149.0") / upstream.BINARY).exists()


def test_other_platforms_and_unpinned_releases_are_unavailable(
    fake_npm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert upstream.upstream_host("0.0.1") is None
    assert "no pinned npm integrity" in upstream.unavailable_reason("0.0.1")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert upstream.upstream_host("0.149.0") is None
    assert "linux x86_64" in upstream.unavailable_reason("0.149.0")


def test_a_missing_member_is_unavailable(fake_npm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with tarfile.open(fake_npm, "w:gz") as archive:
        info = tarfile.TarInfo(upstream.MEMBER)
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        archive.addfile(info)
    digest = hashlib.sha512(fake_npm.read_bytes()).digest()
    monkeypatch.setitem(
        upstream.INTEGRITY, "0.149.0", "sha512-" + base64.b64encode(digest).decode()
    )
    assert upstream.upstream_host("0.149.0") is None
    assert "not a regular file" in upstream.unavailable_reason("0.149.0")
