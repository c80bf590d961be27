"""Example tools for `codemode run examples/orchestrate.js --tools examples/tools.py`.

Plain functions take the cell's one JSON argument; `@tool` functions get typed, validated
arguments and a JSON Schema from their hints.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib

from codemode.model import tool

_WEATHER = {"paris": (18, "cloudy"), "lisbon": (24, "sunny"), "oslo": (9, "rain")}


async def weather(args: dict[str, object]) -> dict[str, object]:
    """Current weather for {"city": ...} (async: pretends to call a remote API)."""
    await asyncio.sleep(0.05)
    city = str(args.get("city", "")).lower()
    if city not in _WEATHER:
        raise ValueError(f"unknown city {city!r}")
    temperature, sky = _WEATHER[city]
    return {"city": city, "celsius": temperature, "sky": sky}


@tool(namespace="math")
def mean(values: list[float]) -> float:
    """Arithmetic mean of a non-empty list of numbers."""
    return sum(values) / len(values)


def bar_chart(args: dict[str, object]) -> str:
    """A tiny PNG bar chart of {"values": [numbers]} as a data: URL."""
    raw = args.get("values", [])
    values = [float(v) for v in raw] if isinstance(raw, list) else []
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
