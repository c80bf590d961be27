"""MCP servers (the official SDK) as tool sources, through real cells: a stdio server written with
the SDK (``mcp_server.py`` beside this file) and the same server over streamable HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import StdioServerParameters

from codemode.model import CodeMode, ToolRegistry
from codemode.model.typescript import render_tool_declaration
from codemode.protocol.types import ToolName
from codemode.tools import mcp_tools
from tests.tools.cells import run_cell

SERVER = Path(__file__).with_name("mcp_server.py")


def written(path: Path) -> str:
    """What ``path`` holds so far ("" before it exists)."""
    return path.read_text(encoding="utf-8") if path.exists() else ""


def stdio_server(marker: Path | None = None) -> StdioServerParameters:
    env = {} if marker is None else {"CODEMODE_TEST_MARKER": str(marker)}
    return StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=env)


@pytest.mark.timeout(60)
async def test_stdio_server_tools_in_a_real_cell(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    async with mcp_tools("weather", stdio_server(marker)) as tools:
        names = [item.definition.name for item in tools]
        assert names == [
            "mcp__weather__forecast",
            "mcp__weather__shout",
            "mcp__weather__divide",
            "mcp__weather__hang",
            "mcp__weather__until_hang_started",
        ]
        assert tools[0].definition.tool_name == ToolName("forecast", "mcp__weather")
        assert tools[0].definition.description == "Tomorrow's forecast for a city."
        assert render_tool_declaration(tools[0].definition) == (
            "mcp__weather__forecast(args: { city: string; }): Promise<CallToolResult<{\n"
            "  // Temperature in degrees Celsius\n  celsius: number;\n  city: string;\n}>>;"
        )
        assert render_tool_declaration(tools[1].definition) == (
            "mcp__weather__shout(args: { text: string; }): Promise<CallToolResult>;"
        )
        source = """
const report = await tools.mcp__weather__forecast({city: "Oslo"});
text(JSON.stringify(report.structuredContent));
text(JSON.stringify(await tools.mcp__weather__shout({text: "hi"})));
const failed = await tools.mcp__weather__divide({a: 1, b: 0});
text(String(failed.isError)); text(failed.content[0].text);
tools.mcp__weather__hang();  // abandoned when the cell ends: cancelled on the server
text((await tools.mcp__weather__until_hang_started()).structuredContent.result);
"""
        async with CodeMode(ToolRegistry(tools)) as code_mode:
            description = code_mode.exec_description()
            run = await run_cell(code_mode, source)
            assert run.success, run.texts
            assert run.texts == [
                '{"city":"Oslo","celsius":12}',
                '{"content":[{"type":"text","text":"HI"}]}',
                "true",
                "Error executing tool divide: cannot divide by zero",
                "started",
            ]
            deadline = time.monotonic() + 10
            # The server creates the file before it writes the line: wait for the whole line.
            while not written(marker).endswith("\n") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert written(marker) == "cancelled\n"
    assert description.count("Shared MCP Types:") == 1
    assert "### `mcp__weather__forecast`\nTomorrow's forecast for a city." in description


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def http_server() -> Iterator[str]:
    port = free_port()
    with subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as child:
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if child.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the MCP HTTP server did not start") from None
                    time.sleep(0.05)
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            child.terminate()
            child.wait(10)


@pytest.mark.timeout(60)
async def test_streamable_http_server_tools_in_a_real_cell(http_server: str) -> None:
    async with mcp_tools("remote", http_server) as tools, CodeMode(tools) as code_mode:
        run = await run_cell(
            code_mode,
            'const r = await tools.mcp__remote__forecast({city: "Rome"});'
            "text(JSON.stringify(r.structuredContent));"
            "const failed = await tools.mcp__remote__divide({a: 1, b: 0});"
            "text(failed.isError + ': ' + failed.content[0].text);"
            "text(JSON.stringify(ALL_TOOLS.map(t => t.name)))",
        )
    assert run.success, run.texts
    assert run.texts[:2] == [
        '{"city":"Rome","celsius":12}',
        "true: Error executing tool divide: cannot divide by zero",
    ]
    assert "mcp__remote__until_hang_started" in json.loads(run.texts[2])


@pytest.mark.timeout(60)
async def test_an_error_in_the_body_comes_out_bare() -> None:
    with pytest.raises(LookupError, match=r"^mine$"):
        async with mcp_tools("weather", stdio_server()):
            raise LookupError("mine")


@pytest.mark.timeout(60)
async def test_a_server_that_is_not_there() -> None:
    missing = StdioServerParameters(command=str(SERVER.with_name("no-such-server")))
    with pytest.raises(OSError):  # noqa: PT011 - the SDK's own spawn error
        async with mcp_tools("gone", missing):
            pass
