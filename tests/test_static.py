"""Static checks as part of the one test command: ``mypy --strict`` and ``ruff`` must be clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.timeout(620)
def test_mypy_strict() -> None:
    result = run("mypy")  # files and strictness come from pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_ruff_check() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_ruff_format() -> None:
    result = run("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
