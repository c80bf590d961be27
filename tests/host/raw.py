"""What a hand-written client sends a host process and gets back, as plain JSON: the hello it
opens with, the exact ``connection/ready`` bytes, an echo tool definition, and the compact
encoding a raw frame carries; and :func:`exchange`, which runs a script of raw frames against a
host process. Shared by the tests that drive host binaries (ours and upstream's) from outside,
without this package's wire types."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any, Final

from tests.upstream import DEFAULT_VERSION
from tests.wire import FrameReader

HELLO: Final = {
    "type": "connection/hello",
    "supportedVersions": [1],
    "requiredCapabilities": [],
    "optionalCapabilities": ["session-cell-execution-resource-limits"],
}
READY: Final = (
    b'{"type":"connection/ready","selectedVersion":1,'
    b'"capabilities":["session-cell-execution-resource-limits"]}'
)
ECHO: Final = {
    "name": "echo",
    "tool_name": {"name": "echo", "namespace": None},
    "description": "Echo",
    "kind": "function",
    "input_schema": None,
    "output_schema": None,
}


def compact(value: Any) -> bytes:
    """``value`` as compact JSON (no spaces, non-ASCII kept), as hosts write it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def request(request_id: int, body: dict[str, Any]) -> dict[str, Any]:
    """An ``operation/request`` frame's message."""
    return {"type": "operation/request", "id": request_id, "request": body}


def execute(
    request_id: int, source: str, yield_ms: int | None, session: str = "s1", **fields: Any
) -> dict[str, Any]:
    """A ``session/execute`` request for ``source`` with no tools (``fields`` add or replace)."""
    body = {
        "tool_call_id": "call-1",
        "enabled_tools": [],
        "source": source,
        "yield_time_ms": yield_ms,
        "max_output_tokens": None,
        **fields,
    }
    return request(request_id, {"method": "session/execute", "sessionId": session, "request": body})


def our_host(version: str) -> list[str]:
    """Our stdio host, speaking the wire revision of upstream release ``version``."""
    revision = "pinned" if version == DEFAULT_VERSION else "latest"
    return [sys.executable, "-m", "codemode", "host", "--stdio", "--wire-revision", revision]


# -- scripts of raw frames, run against a host process -------------------------------------------

#: A step of a script: ``("send", bytes)`` writes the bytes (frames, whole or not) at once;
#: ``("sleep", seconds)`` pauses; ``("expect", n)`` reads ``n`` frames (fewer if the host ends
#: the connection); ``("until", marker)`` reads frames up to the first that contains the bytes
#: ``marker`` (a script's order made independent of load); ``("end",)`` reads until the host ends
#: the connection.
Step = tuple[Any, ...]

_TIMING: Final = re.compile(rb'"(code_mode_host_duration_ns|result_buffered_for_ns)":\d+')
_READ: Final = 15.0
_QUIET: Final = 3.0  # no frame for so long at an ("end",): the connection stayed open


def frame(message: dict[str, Any] | bytes) -> bytes:
    """One frame of ``message`` (compact JSON) or of payload bytes as they are."""
    payload = message if isinstance(message, bytes) else compact(message)
    return struct.pack("<I", len(payload)) + payload


@dataclass
class Exchange:
    """What a host wrote for a script (timing fields masked), and its exit status."""

    frames: list[bytes]
    status: int | None


async def exchange(command: list[str], script: list[Step], *, linger: float = 0.0) -> Exchange:
    """Run ``script`` against a fresh host process: every frame it wrote until it exited (the
    timing fields of the ``latest`` revision masked), and its exit status. After the script,
    ``linger`` seconds pass before the host's stdin is closed. A host that ends the connection
    ends the script: what it wrote is the answer."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdin is not None and process.stdout is not None
    reader = FrameReader(process.stdout)
    frames: list[bytes] = []
    try:
        for step in script:
            if step[0] == "send":
                try:
                    process.stdin.write(step[1])
                    await process.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    break
            elif step[0] == "sleep":
                await asyncio.sleep(step[1])
            elif step[0] == "expect":
                for _ in range(step[1]):
                    payload = await reader.read(_READ)
                    if payload is None:
                        break
                    frames.append(payload)
            elif step[0] == "until":
                try:
                    while (payload := await reader.read(_READ)) is not None:
                        frames.append(payload)
                        if step[1] in payload:
                            break
                except TimeoutError:
                    frames.append(b"(no frame contained " + step[1] + b")")
            else:
                try:
                    while (payload := await reader.read(_QUIET)) is not None:
                        frames.append(payload)
                except TimeoutError:
                    frames.append(b"(the connection stayed open)")
        await asyncio.sleep(linger)
        process.stdin.close()
        while (payload := await reader.read(_READ)) is not None:
            frames.append(payload)
        status = await asyncio.wait_for(process.wait(), _READ)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return Exchange([_TIMING.sub(rb'"\1":0', payload) for payload in frames], status)
