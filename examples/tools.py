"""Example tools for `codemode run examples/orchestrate.js --tools examples/tools.py`.

Every public function is a tool: its parameters are the properties of the object a cell passes
(typed and validated from the hints), its docstring the description and its return annotation the
result type the model is shown. `@tool` adds a namespace, another name or a schema.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib
from typing import Any

from codemode.model import tool

_WEATHER = {"paris": (18, "cloudy"), "lisbon": (24, "sunny"), "oslo": (9, "rain")}


async def weather(city: str) -> dict[str, Any]:
    """Current weather in a city (async: pretends to call a remote API)."""
    await asyncio.sleep(0.05)
    city = city.lower()
    if city not in _WEATHER:
        raise ValueError(f"unknown city {city!r}")
    temperature, sky = _WEATHER[city]
    return {"city": city, "celsius": temperature, "sky": sky}


@tool(namespace="math")
def mean(values: list[float]) -> float:
    """Arithmetic mean of a non-empty list of numbers."""
    return sum(values) / len(values)


def bar_chart(values: list[float]) -> str:
    """A tiny PNG bar chart of the values, as a data: URL."""
    width, height = 12 * max(1, len(values)), 40
    top = max(values, default=1.0) or 1.0
    rows = []
    for y in range(height):
        row = bytearray([0])
        for x in range(width):
            bar = x // 12
            filled = bar < len(values) and x % 12 < 10 and height - y <= values[bar] / top * height
            row += b"\x30\x60\xd0" if filled else b"\xff\xff\xff"
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    png = b"\x89PNG\r\n\x1a\n" + chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    )
    png += chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()
