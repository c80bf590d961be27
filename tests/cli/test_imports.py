"""What each command imports: a command loads only what it uses.

The optional libraries are slow to import (the MCP SDK alone takes longer than the rest of a
``codemode run``), and a host's start-up is what a client waits for before its first cell, so a
command must not import a carrier or tool source it was not asked for. Each case runs the real
command in a fresh interpreter and lists, at its exit, which of the watched modules were loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wire import frame, hello

pytestmark = pytest.mark.timeout(60)

WATCHED = ("mcp", "websockets", "grpc", "codemode.model", "codemode.tools", "langchain_core")


def loaded(entry: str, args: list[str], stdin: bytes = b"") -> set[str]:
    """Run ``entry``'s ``main(args)`` in a fresh interpreter; the watched modules it loaded."""
    code = (
        "import atexit, json, sys\n"
        f"watched = {WATCHED!r}\n"
        "atexit.register(lambda: sys.stderr.write('\\nLOADED ' + json.dumps("
        "[name for name in watched if name in sys.modules]) + '\\n'))\n"
        f"from {entry} import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, timeout=50, check=False
    )
    marker = done.stderr.decode().rpartition("\nLOADED ")[2]
    assert done.returncode == 0, done.stderr.decode()
    return set(json.loads(marker))


def test_run_without_mcp_servers_does_not_import_the_mcp_sdk(tmp_path: Path) -> None:
    cell = tmp_path / "cell.js"
    cell.write_text("text(1)")
    assert loaded("codemode.cli", ["run", str(cell)]) <= {"codemode.model"}


@pytest.mark.parametrize(
    ("entry", "args"),
    [
        ("codemode.cli", ["host", "--stdio"]),
        ("codemode.cli.codex_host", []),
    ],
)
def test_a_stdio_host_imports_no_other_carrier_and_no_model_layer(
    entry: str, args: list[str]
) -> None:
    assert loaded(entry, args, stdin=frame(hello(()))) == set()
