"""``codemode run --mcp NAME='COMMAND ARGS'``: stdio MCP servers started for one run."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from tests.commands import codemode

SERVER = Path(__file__).with_name("mcp_server.py")
SERVER_COMMAND = shlex.join([sys.executable, str(SERVER)])


@pytest.mark.timeout(90)
def test_run_with_mcp_servers_and_a_tool_file(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
    source = (
        b'const r = await tools.mcp__weather__forecast({city: "Oslo"});'
        b"text(JSON.stringify(r.structuredContent));"
        b'text(JSON.stringify(await tools.mcp__again__shout({text: "hi"})));'
        b"text((await tools.mcp__weather__divide({a: 1, b: 0})).content[0].text);"
        b"text(String(await tools.add({a: 1, b: 2})));"
    )
    done = codemode(
        "run",
        "-",
        "--json",
        "--tools",
        str(tools),
        "--mcp",
        f"weather={SERVER_COMMAND}",
        "--mcp",
        f"again={SERVER_COMMAND}",
        stdin=source,
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)["Result"]
    assert result["error_text"] is None
    assert [item["text"] for item in result["content_items"]] == [
        '{"city":"Oslo","celsius":12}',
        '{"content":[{"type":"text","text":"HI"}]}',
        "Error executing tool divide: cannot divide by zero",
        "3",
    ]


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("weather", b"expected NAME='COMMAND ARGS'"),
        ("=python server.py", b"expected NAME='COMMAND ARGS'"),
        ("weather=", b"MCP server weather has no command"),
        ("weather='unterminated", b"cannot split the command of weather"),
        ("weather=/nonexistent/server", b"cannot start MCP server weather (/nonexistent/server)"),
        (f"weather={shlex.join([sys.executable, '-c', 'pass'])}", b"cannot start MCP server"),
    ],
)
@pytest.mark.timeout(60)
def test_run_mcp_usage_errors_exit_2(argument: str, message: bytes) -> None:
    done = codemode("run", "-", "--mcp", argument, stdin=b"text(1)")
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.timeout(90)
def test_run_mcp_servers_whose_tools_are_one_identifier_exit_2() -> None:
    # `a-b` and `a_b` both gave `tools.mcp__a_b__forecast`: the second server's tools silently
    # took the first one's calls.
    done = codemode(
        "run",
        "-",
        "--mcp",
        f"a-b={SERVER_COMMAND}",
        "--mcp",
        f"a_b={SERVER_COMMAND}",
        stdin=b"text(1)",
    )
    assert done.returncode == 2
    assert done.stdout == b""
    assert b"codemode: MCP server a_b: tool `mcp__a_b__" in done.stderr, done.stderr
    assert b"` in a cell, which tool `mcp__a-b__" in done.stderr
