"""Every exact text a V1 connection emits, host side and client side, named by meaning.

Peers and tests compare these byte for byte (the specification's code is in each comment).
Texts with placeholders are functions; the rest are constants. Nothing else in the package
formats a V1 operation, callback or connection-error text.
"""

from __future__ import annotations

from typing import Final

from codemode.protocol.constants import SESSION_RESOURCE_LIMITS_CAPABILITY
from codemode.protocol.texts import TOO_MANY_CALLBACKS

__all__ = ["TOO_MANY_CALLBACKS"]  # J1 / D1, shared with the embedded runtime; the rest below

# -- host → client operation errors -----------------------------------------------------------------

#: H1
REQUEST_CANCELLED: Final = "code-mode request cancelled"
#: H2
TOO_MANY_REQUESTS: Final = "code-mode host has too many in-flight requests"
#: H3
TOO_MANY_CELLS: Final = "code-mode host has too many active cells"
#: H4
HOST_SHUTTING_DOWN: Final = "code-mode host is shutting down"
#: H9
LIMITS_NOT_NEGOTIATED: Final = (
    "invalid code-mode session execution limits: capability "
    f"`{SESSION_RESOURCE_LIMITS_CAPABILITY}` was not negotiated"
)


def unknown_session(session_id: str) -> str:
    """H5"""
    return f"unknown code-mode session {session_id}"


def invalid_execute_request(detail: object) -> str:
    """H6"""
    return f"invalid code-mode execute request: {detail}"


def response_too_large(detail: str) -> str:
    """H8: an answer of the host does not fit in one frame."""
    return f"code-mode host response exceeds the IPC frame limit: {detail}"


def session_already_open(session_id: str) -> str:
    """H10"""
    return f"code-mode session ID `{session_id}` is already open"


def session_id_reused(session_id: str) -> str:
    """H11"""
    return f"code-mode session ID `{session_id}` was reused"


def host_internal_error(error: BaseException) -> str:
    """What a request answers when the host's own operation failed unexpectedly."""
    return f"code-mode host internal error: {type(error).__name__}: {error}"


# -- handshake ------------------------------------------------------------------------------------

#: The ``invalidHello`` message of a first message that is not a hello.
FIRST_MESSAGE_MUST_BE_HELLO: Final = "first message must be connection/hello"


def no_compatible_version(versions: object) -> str:
    """C4 reason for ``noCompatibleVersion``."""
    return f"no compatible protocol version (host supports {versions})"


def missing_required_capability(capability: str) -> str:
    """C4 reason for ``missingRequiredCapability``."""
    return f"missing required capability `{capability}`"


def invalid_hello(message: str) -> str:
    """C4 reason for ``invalidHello``."""
    return f"invalid hello: {message}"


# -- callbacks, as JavaScript sees them (J) and as the client answers them (D) ------------------------

#: J2
INVALID_TOOL_RESULT: Final = "code-mode client returned an invalid tool result"
#: J3
INVALID_NOTIFICATION_RESULT: Final = "code-mode client returned an invalid notification result"
#: J4
CLIENT_CONNECTION_CLOSED: Final = "code-mode client connection closed"
#: What a callback answers once the host revoked it and the runtime's grace ran out.
CALLBACK_REVOKED: Final = "code-mode callback was revoked"


def callback_too_large(detail: str) -> str:
    """J5: a tool call's request does not fit in one frame. The frame's own error text, as both
    upstream releases give it (the spec's J5 puts `code-mode delegate request exceeds the IPC
    frame limit: ` before it; docs/interop.md)."""
    return detail


def callback_for_unknown_session(session_id: str) -> str:
    """D2"""
    return f"code-mode host delegated for unknown session {session_id}"


def callback_for_unknown_cell(cell_id: str, session_id: str) -> str:
    """D3"""
    return f"code-mode host delegated for unknown cell {cell_id} in session {session_id}"


def answer_too_large(detail: str) -> str:
    """D6: the delegate's answer does not fit in one frame."""
    return f"code-mode delegate response exceeds the IPC frame limit: {detail}"


# -- host connection errors and log lines (L) ---------------------------------------------------

#: L3
SECOND_HELLO: Final = "received a second code-mode client hello"
#: L8
CLIENT_SENT_TEXT: Final = "code-mode client sent a text WebSocket message"
#: L9
BULK_NOT_ESTABLISHED: Final = "code-mode bulk connection was not established"


def hello_read_failed(detail: str) -> str:
    """L1"""
    return f"failed to read code-mode client hello: {detail}"


def client_read_failed(detail: str) -> str:
    """L2"""
    return f"failed to read code-mode client message: {detail}"


def client_write_failed(detail: str) -> str:
    """The host could not write to its client (a log line; the connection ends)."""
    return f"failed to write code-mode client message: {detail}"


def duplicate_request_id(request_id: int) -> str:
    """L4"""
    return f"duplicate code-mode request ID {request_id}"


def client_wrong_lane(message_type: str, lane: str) -> str:
    """L5"""
    return f"code-mode message {message_type} is not allowed on the {lane} socket"


def unknown_callback_answered(delegate_id: int) -> str:
    """L6"""
    return f"code-mode client returned unknown delegate request ID {delegate_id}"


# -- errors raised to callers of a remote session (C) ---------------------------------------------

#: C2
HANDSHAKE_TIMED_OUT: Final = "timed out negotiating with the code-mode host"
#: C3
HOST_EXITED_DURING_HANDSHAKE: Final = "code-mode host exited during handshake"
#: C7
HOST_LACKS_LIMITS: Final = (
    "code-mode host does not support session resource limits: "
    f"missing `{SESSION_RESOURCE_LIMITS_CAPABILITY}` capability"
)
#: C10
SESSION_CLOSED_DURING_EXECUTE: Final = "code-mode session closed during execute"


def handshake_rejected(reason: str) -> str:
    """C4"""
    return f"code-mode host rejected the handshake: {reason}"


def invalid_handshake_reply(detail: str) -> str:
    """C5"""
    return f"code-mode host returned an invalid handshake response: {detail}"


def bulk_unavailable(detail: str) -> str:
    """C6"""
    return f"code-mode host bulk connection is unavailable: {detail}"


# -- client connection-failure reasons (K) --------------------------------------------------------

#: K1
HOST_CONNECTION_CLOSED: Final = "code-mode host connection closed"
#: K5
SECOND_HANDSHAKE_REPLY: Final = "code-mode host sent a second handshake response"
#: K7
HOST_SENT_TEXT: Final = "code-mode host sent a text WebSocket message"
#: K9
INVALID_OPEN_RESPONSE: Final = "code-mode host returned an invalid open-session response"
#: K10
INVALID_EXECUTE_RESPONSE: Final = "code-mode host returned an invalid execute response"
#: K11
INVALID_CELL_RESPONSE: Final = "code-mode host returned an invalid cell response"
#: K12
INVALID_SHUTDOWN_RESPONSE: Final = "code-mode host returned an invalid shutdown response"
#: K19
REQUEST_IDS_EXHAUSTED: Final = "code-mode host request ID space exhausted"


def host_timed_out(operation: str) -> str:
    """The host let a request pass its deadline (the client's ``grpc.md`` §13.3 rule)."""
    return f"code-mode host timed out waiting for {operation} response"


def host_exited(status: object) -> str:
    """K2"""
    return f"code-mode host exited with status {status}"


def host_read_failed(detail: str) -> str:
    """K3"""
    return f"failed to read code-mode host message: {detail}"


def host_write_failed(detail: str) -> str:
    """K4"""
    return f"failed to write code-mode host message: {detail}"


def host_wrong_lane(message_type: str, lane: str) -> str:
    """K6"""
    return f"code-mode host sent {message_type} on the {lane} socket"


def unknown_request_id(request_id: int) -> str:
    """K8"""
    return f"code-mode host returned unknown request ID {request_id}"


def shutdown_failed(session_id: str, message: str) -> str:
    """K13"""
    return f"code-mode host failed to shut down session {session_id}: {message}"


def wrong_cell_answered(got: str, want: str | None) -> str:
    """K14"""
    return f"code-mode host returned cell {got} for request targeting {want}"


def wrong_initial_response(got: str, want: str | None) -> str:
    """K15"""
    return f"code-mode host returned an initial response for cell {got} instead of {want}"


def live_cell_reused(session_id: str) -> str:
    """K16"""
    return f"code-mode host reused live cell ID in session {session_id}"


def duplicate_callback_id(delegate_id: int) -> str:
    """K17"""
    return f"duplicate code-mode delegate request ID {delegate_id}"


def unknown_cell_closed(cell_id: str, session_id: str) -> str:
    """K18"""
    return f"code-mode host closed unknown cell {cell_id} in session {session_id}"
