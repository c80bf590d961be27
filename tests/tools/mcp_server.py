"""A real MCP server (the official SDK's ``MCPServer``) for the tests: stdio, or HTTP on a port.

``python mcp_server.py`` serves stdio; ``python mcp_server.py http PORT`` serves streamable HTTP on
127.0.0.1:PORT at ``/mcp``. ``hang`` blocks until cancelled and then appends ``cancelled`` to the
file named by ``$CODEMODE_TEST_MARKER`` (when set), so a test can see the cancellation arrive.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field

server = MCPServer("weather", instructions="Weather of made-up cities.")
hang_started = anyio.Event()


class Forecast(BaseModel):
    city: str
    celsius: int = Field(description="Temperature in degrees Celsius")


@server.tool()
def forecast(city: str) -> Forecast:
    """Tomorrow's forecast for a city."""
    return Forecast(city=city, celsius=len(city) * 3)


@server.tool(structured_output=False)
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("cannot divide by zero")
    return a / b


@server.tool()
async def hang() -> str:
    """Never returns; records its cancellation."""
    hang_started.set()
    try:
        await anyio.sleep_forever()
    finally:
        marker = os.environ.get("CODEMODE_TEST_MARKER")
        if marker:
            with Path(marker).open("a", encoding="utf-8") as file:
                file.write("cancelled\n")
    return "unreachable"


@server.tool()
async def until_hang_started() -> str:
    """Returns once `hang` runs."""
    await hang_started.wait()
    return "started"


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        anyio.run(lambda: server.run_streamable_http_async(port=int(sys.argv[2])))
    else:
        server.run()
