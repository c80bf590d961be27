"""The committed generated code is exactly what ``scripts/generate_grpc.py`` makes of the proto.

This is the check that regeneration is a no-op: it runs the script into a temporary directory with
the pinned generators and compares every file byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "generate_grpc.py"
COMMITTED = [
    "src/codemode/protocol/grpc/v1_pb2.py",
    "src/codemode/protocol/grpc/v1_pb2.pyi",
    "src/codemode/grpc_stubs/v1_pb2_grpc.py",
    "src/codemode/grpc_stubs/v1_pb2_grpc.pyi",
]

pytest.importorskip(
    "grpc_tools",
    reason="grpcio-tools is not installed (pip install -e '.[test]'): cannot regenerate the stubs",
)
pytest.importorskip(
    "mypy_protobuf",
    reason="mypy-protobuf is not installed (pip install -e '.[test]'): cannot regenerate the stubs",
)


@pytest.mark.timeout(120)
def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--output-root", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(COMMITTED)
    stale = [
        relative
        for relative in COMMITTED
        if (tmp_path / relative).read_bytes() != (ROOT / relative).read_bytes()
    ]
    assert not stale, f"out of date, run scripts/generate_grpc.py: {stale}"


@pytest.mark.timeout(120)
def test_the_check_mode_agrees() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
