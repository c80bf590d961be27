"""Protocol constants (``protocol-v1.md`` §1.2)."""

from __future__ import annotations

from typing import Final

PUBLIC_TOOL_NAME: Final = "exec"
WAIT_TOOL_NAME: Final = "wait"
CODE_MODE_PRAGMA_PREFIX: Final = "// @exec:"
DEFAULT_EXEC_YIELD_TIME_MS: Final = 10_000
DEFAULT_WAIT_YIELD_TIME_MS: Final = 10_000
DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL: Final = 10_000
MAX_JS_SAFE_INTEGER: Final = 2**53 - 1
PROTOCOL_VERSION_V1: Final = 1
SESSION_RESOURCE_LIMITS_CAPABILITY: Final = "session-cell-execution-resource-limits"
DUAL_WEBSOCKET_CAPABILITY: Final = "dual-websocket-v1"
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
MAX_WEBSOCKET_MESSAGE_BYTES: Final = MAX_FRAME_BYTES + 4
MAX_PENDING_DELEGATE_CALLS: Final = 1024
DEFAULT_MAX_IN_FLIGHT_REQUESTS: Final = 256
DEFAULT_MAX_ACTIVE_CELLS: Final = 128
RECENT_ID_MEMORY: Final = 4096
HANDSHAKE_TIMEOUT: Final = 10.0
BULK_PAIRING_TIMEOUT: Final = 10.0
SHUTDOWN_TIMEOUT: Final = 5.0
#: What a client allows every request on top of its runtime allowance before it gives the host
#: up as silent (``grpc.md`` §13.3; the V1 client applies the same rule).
TRANSPORT_ALLOWANCE: Final = 60.0
#: How long a cancelled delegate callback may take to finish before it is abandoned (runtime §4.5).
CALLBACK_GRACE: Final = 0.1

U64_MAX: Final = 2**64 - 1
I64_MIN: Final = -(2**63)
I64_MAX: Final = 2**63 - 1
I32_MIN: Final = -(2**31)
I32_MAX: Final = 2**31 - 1
U32_MAX: Final = 2**32 - 1
