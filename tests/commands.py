"""The ``codemode`` command line, run as a real subprocess by the tests."""

from __future__ import annotations

import subprocess
import sys


def codemode(
    *args: str, stdin: bytes = b"", timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m codemode ARGS`` with ``stdin``; its status and raw output."""
    return subprocess.run(
        [sys.executable, "-m", "codemode", *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
