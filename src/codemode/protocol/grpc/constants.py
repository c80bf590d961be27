"""Names and limits of the gRPC carriage (``grpc.md`` §1, §3, §6.3, §11)."""

from __future__ import annotations

from typing import Final

#: The proto package and service (§1, §2).
PROTO_PACKAGE: Final = "codex.code_mode.v1"
SERVICE_NAME: Final = f"{PROTO_PACKAGE}.CodeModeHost"
#: Every rpc's path starts with this, e.g. ``/codex.code_mode.v1.CodeModeHost/OpenSession`` (§1).
SERVICE_PATH_PREFIX: Final = f"/{SERVICE_NAME}/"

#: Both peers allow messages up to this size in each direction (§1, §11).
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: ``MAX_IDENTIFIER_BYTES``: the longest identifier, in UTF-8 bytes (§3).
MAX_IDENTIFIER_BYTES: Final = 256
#: A tool's failure message is cut to at most this many UTF-8 bytes, suffix included (§6.3).
MAX_TOOL_ERROR_MESSAGE_BYTES: Final = 64 * 1024
