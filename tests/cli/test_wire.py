"""``codemode wire``: its exit statuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands import codemode

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_wire_frames_of_a_file_it_cannot_read_is_a_usage_error(tmp_path: Path, kind: str) -> None:
    # Status 1 said "a frame failed"; `codemode run` makes an unreadable FILE a usage error (2).
    path = tmp_path / "capture.bin"
    if kind == "directory":
        path.mkdir()
    done = codemode("wire", "frames", str(path))
    assert done.returncode == 2
    assert done.stdout == b""
    reason = "No such file or directory" if kind == "missing" else "Is a directory"
    assert done.stderr == f"codemode: cannot read {path}: {reason}\n".encode()
