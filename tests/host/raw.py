"""What a hand-written client sends a host process and gets back, as plain JSON: the hello it
opens with, the exact ``connection/ready`` bytes, an echo tool definition, and the compact
encoding a raw frame carries. Shared by the tests that drive host binaries (ours and upstream's)
from outside, without this package's wire types."""

from __future__ import annotations

import json
from typing import Any, Final

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
