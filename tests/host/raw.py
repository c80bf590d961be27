"""What a hand-written client sends a host process and gets back, as plain JSON: the hello it
opens with, the exact ``connection/ready`` bytes, an echo tool definition, and the compact
encoding a raw frame carries. Shared by the tests that drive host binaries (ours and upstream's)
from outside, without this package's wire types."""

from __future__ import annotations

import json
import sys
from typing import Any, Final

from tests.upstream import DEFAULT_VERSION

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
