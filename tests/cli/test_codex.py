"""``codemode codex link`` / ``unlink`` and the ``codex-code-mode-host`` command line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from codemode.cli import codex
from codemode.cli.codex_host import host_arguments
from tests.commands import codemode

ELF = b"\x7fELF fake codex"


@pytest.fixture
def native(tmp_path: Path) -> Path:
    binary = tmp_path / "install" / "bin" / "codex"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(ELF)
    binary.chmod(0o755)
    return binary


def test_link_builds_a_layout_and_unlink_removes_exactly_it(tmp_path: Path, native: Path) -> None:
    layout = tmp_path / "layout"
    done = codemode("codex", "link", str(layout), "--codex", str(native))
    assert done.returncode == 0, done.stderr
    assert f"{layout / 'codex'} (hard link of {native})" in done.stdout.decode()
    assert (layout / "codex").read_bytes() == ELF
    assert os.stat(layout / "codex").st_ino == os.stat(native).st_ino
    host = layout / "codex-code-mode-host"
    assert os.access(host, os.X_OK)
    assert "-m codemode.cli.codex_host" in host.read_text()
    # Linking again rebuilds the layout; unlink removes it and leaves the original alone.
    assert codemode("codex", "link", str(layout), "--codex", str(native)).returncode == 0
    done = codemode("codex", "unlink", str(layout))
    assert done.returncode == 0, done.stderr
    assert not layout.exists()
    assert native.read_bytes() == ELF


def test_the_layout_host_serves_v1_on_stdio(tmp_path: Path, native: Path) -> None:
    """The generated ``codex-code-mode-host`` starts and answers a hello (Protocol V1)."""
    layout = tmp_path / "layout"
    codex.link(layout, str(native))
    hello = b'{"type":"connection/hello","supportedVersions":[1],"requiredCapabilities":[],"optionalCapabilities":[]}'
    done = subprocess.run(
        [str(layout / "codex-code-mode-host")],
        input=len(hello).to_bytes(4, "little") + hello,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert b'"type":"connection/ready"' in done.stdout


def test_link_refuses_a_directory_it_did_not_make(tmp_path: Path, native: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("keep")
    done = codemode("codex", "link", str(occupied), "--codex", str(native))
    assert done.returncode == 1
    assert b"exists and is not empty" in done.stderr
    done = codemode("codex", "unlink", str(occupied))
    assert done.returncode == 1
    assert b"is not a layout made by `codemode codex link`" in done.stderr
    assert (occupied / "mine.txt").read_text() == "keep"


def test_npm_launcher_is_followed_to_the_native_binary(tmp_path: Path) -> None:
    package = tmp_path / "node_modules" / "@openai" / "codex"
    launcher = package / "bin" / "codex.js"
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/usr/bin/env node\n")
    binary = package / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(ELF)
    on_path = tmp_path / "bin" / "codex"
    on_path.parent.mkdir()
    on_path.symlink_to(launcher)
    assert codex.native_codex(str(on_path)) == binary.resolve()


def test_a_script_without_a_binary_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "codex"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(codex.LayoutError, match="is not the native codex executable"):
        codex.native_codex(str(script))
    with pytest.raises(codex.LayoutError, match="no such file"):
        codex.native_codex(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["host", "--stdio", "--wire-revision", "auto"]),
        (["--listen", "stdio"], ["host", "--stdio", "--wire-revision", "auto"]),
        (["--listen", "stdio://"], ["host", "--stdio", "--wire-revision", "auto"]),
        (["--listen", "grpc+stdio://"], ["host", "--listen", "grpc+stdio://"]),
        (["--listen", "grpc://127.0.0.1:0"], ["host", "--listen", "grpc://127.0.0.1:0"]),
        (["--listen", "ws://127.0.0.1:0"], ["host", "--listen", "ws://127.0.0.1:0"]),
        (
            ["--listen", "grpc+stdio://", "--otel-trace-exporter", "http://127.0.0.1:1"],
            ["host", "--listen", "grpc+stdio://"],
        ),
    ],
)
def test_codex_host_command_line(argv: list[str], expected: list[str]) -> None:
    assert host_arguments(argv) == expected
