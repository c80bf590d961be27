"""The tool sources keep their libraries optional: nothing heavy is imported until used."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_codemode_and_the_tool_sources_imports_no_optional_library() -> None:
    probe = (
        "import sys, json, codemode, codemode.model, codemode.tools, codemode.cli.run\n"
        "print(json.dumps([m for m in ('pydantic', 'mcp', 'langchain_core') if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, timeout=60, check=True
    )
    assert json.loads(done.stdout) == []
