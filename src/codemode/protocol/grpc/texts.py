"""Every exact text the gRPC conversions and identifier checks produce, named by meaning.

Peers and tests compare these byte for byte; each comment gives the section of ``grpc.md`` and, in
quotes, its wording (``⟨…⟩`` are the placeholders). Texts with placeholders are functions; the
rest are constants. Texts the specification leaves open (``⟨detail⟩``, ``⟨reason⟩``) are this
project's and say so.
"""

from __future__ import annotations

from typing import Final

from codemode.protocol.grpc.constants import MAX_IDENTIFIER_BYTES

# -- decoding an outcome (client side, §10) ----------------------------------------------------------

#: §10 "code-mode execution omitted its outcome": an ``ExecutionOutcome`` without its ``outcome`` oneof.
EXECUTION_OMITTED_OUTCOME: Final = "code-mode execution omitted its outcome"
#: §10 "code-mode wait omitted its outcome": a ``WaitResponse`` without its ``state`` oneof.
WAIT_OMITTED_OUTCOME: Final = "code-mode wait omitted its outcome"
#: §10 "code-mode execution returned an empty content item": a ``ContentItem`` without its ``item``.
EMPTY_CONTENT_ITEM: Final = "code-mode execution returned an empty content item"


def invalid_image_detail(value: int) -> str:
    """§10 "code-mode image has invalid detail value ⟨V⟩" (present but unspecified or unknown)."""
    return f"code-mode image has invalid detail value {value}"


# -- identifiers the host returned (client side, §3, §10, §13.2, §13.4) ------------------------------
# ⟨what⟩ is one of "session ID", "cell ID", "tool call ID", "notification call ID".


def host_returned_empty_identifier(what: str) -> str:
    """§10, §13.2 "gRPC code-mode host returned an empty cell ID" / "… an empty session ID"."""
    return f"gRPC code-mode host returned an empty {what}"


def host_returned_long_identifier(what: str) -> str:
    """§13.4 "gRPC code-mode host returned ⟨field⟩ exceeding 256 bytes"."""
    return f"gRPC code-mode host returned {what} exceeding {MAX_IDENTIFIER_BYTES} bytes"


#: §13.4 "code-mode tool invocation ID must be a UUID".
INVOCATION_ID_NOT_UUID: Final = "code-mode tool invocation ID must be a UUID"
#: §7 "code-mode notification ID must be a UUID".
NOTIFICATION_ID_NOT_UUID: Final = "code-mode notification ID must be a UUID"

# -- identifiers a client sent (host side, §3, §12.1) ------------------------------------------------
# Upstream 0.171.0's texts, which win over §12.1's "invalid code-mode ⟨field⟩: ⟨reason⟩" (its
# Decision left them open): "code-mode ⟨what⟩ ID must not be empty", "… exceeds 256 bytes", "… must
# be a UUID", ⟨what⟩ naming the proto field as below.

#: The ⟨what⟩ of each identifier field a host checks.
IDENTIFIER_NAMES: Final = {
    "session_id": "session",
    "execution_id": "execution",
    "wait_id": "wait",
    "cell_id": "cell",
    "tool_call_id": "tool call",
    "invocation_id": "tool invocation",
    "notification_id": "notification",
}


def invalid_identifier(field: str, reason: str) -> str:
    """ "code-mode ⟨what⟩ ID ⟨reason⟩"; ``field`` is the proto field (``session_id``)."""
    return f"code-mode {IDENTIFIER_NAMES.get(field, field)} ID {reason}"


#: ⟨reason⟩ of an empty identifier.
IDENTIFIER_EMPTY: Final = "must not be empty"
#: ⟨reason⟩ of an identifier over ``MAX_IDENTIFIER_BYTES``.
IDENTIFIER_TOO_LONG: Final = f"exceeds {MAX_IDENTIFIER_BYTES} bytes"
#: ⟨reason⟩ of an identifier that must be a UUID and is not.
IDENTIFIER_NOT_UUID: Final = "must be a UUID"

# -- execute requests and session limits ---------------------------------------------------------
# An invalid tool definition is INVALID_ARGUMENT with upstream 0.171.0's texts (§12.1's
# "invalid code-mode execute request: ⟨detail⟩" is not what upstream says).

#: An enabled tool without ``tool_name``.
TOOL_DEFINITION_MISSING_TOOL_NAME: Final = "tool definition is missing its tool name"
#: An enabled tool whose kind is ``TOOL_KIND_UNSPECIFIED`` or no ``ToolKind`` value.
TOOL_DEFINITION_INVALID_KIND: Final = "tool definition has an invalid kind"


def tool_field_empty(what: str) -> str:
    """ "code-mode ⟨what⟩ must not be empty" (``tool definition name``, ``tool name``)."""
    return f"code-mode {what} must not be empty"


def tool_field_too_long(what: str) -> str:
    """ "code-mode ⟨what⟩ exceeds 256 bytes" (``tool definition name``, ``tool name``,
    ``tool namespace``)."""
    return f"code-mode {what} exceeds {MAX_IDENTIFIER_BYTES} bytes"


def tool_schema_not_json(which: str, detail: str) -> str:
    """ "invalid tool ⟨input|output⟩ schema: ⟨detail⟩": a schema that is not strict UTF-8 JSON
    (⟨detail⟩ is this project's JSON parser's; upstream's is serde_json's)."""
    return f"invalid tool {which} schema: {detail}"


def tool_input_schema_not_encodable(detail: str) -> str:
    """§10 "failed to encode code-mode tool input schema: ⟨detail⟩"."""
    return f"failed to encode code-mode tool input schema: {detail}"


def tool_output_schema_not_encodable(detail: str) -> str:
    """The output-schema twin of the text above (upstream's wording; §10 names only the input's)."""
    return f"failed to encode code-mode tool output schema: {detail}"


def invalid_heap_size_limit(detail: str) -> str:
    """§10 "invalid code-mode heap size limit: ⟨detail⟩" (a limit that does not fit a uint64)."""
    return f"invalid code-mode heap size limit: {detail}"


# -- nested tool calls (client side, §6, §13.4) -------------------------------------------------------

#: §13.4 "code-mode tool invocation omitted its tool name" (answered, the session stays open).
TOOL_CALL_OMITTED_TOOL_NAME: Final = "code-mode tool invocation omitted its tool name"


def tool_not_enabled(name: str) -> str:
    """§13.4 "code-mode tool ⟨name⟩ is not enabled for this execution" (answered).

    Also the answer to a ``ToolCall`` whose kind is unspecified or unknown: no enabled tool has it.
    """
    return f"code-mode tool {name} is not enabled for this execution"


def tool_call_input_not_json(detail: str) -> str:
    """A ``ToolCall.input_json`` that is not strict JSON (upstream's wording; not in ``grpc.md``)."""
    return f"code-mode tool invocation contains invalid JSON: {detail}"


# -- tool results (client side, §6.3, §11) -------------------------------------------------------------

#: §6.3 "… [truncated]": ends a failure message that was cut to fit 64 KiB.
TRUNCATED_SUFFIX: Final = "... [truncated]"


def tool_result_not_encodable(detail: str) -> str:
    """§6.3 "failed to encode code-mode tool result: ⟨detail⟩"."""
    return f"failed to encode code-mode tool result: {detail}"


def tool_result_too_large(size: int, limit: int) -> str:
    """§6.3 "code-mode tool result of ⟨N⟩ encoded bytes exceeds the gRPC message limit of ⟨M⟩ bytes"."""
    return (
        f"code-mode tool result of {size} encoded bytes exceeds the gRPC message limit of "
        f"{limit} bytes"
    )


# -- host statuses (host side, §4.1, §6.3, §7, §8, §11, §12.1) ------------------------------------


def unknown_session(session_id: str) -> str:
    """§12.1 ``NOT_FOUND`` "unknown code-mode session ⟨id⟩"."""
    return f"unknown code-mode session {session_id}"


def invalid_session_limits(detail: str) -> str:
    """§12.1 ``INVALID_ARGUMENT`` "invalid code-mode session execution limits: ⟨detail⟩"."""
    return f"invalid code-mode session execution limits: {detail}"


#: §12.1 ``FAILED_PRECONDITION`` "code-mode host cannot enforce heap limits".
HOST_CANNOT_ENFORCE_HEAP_LIMITS: Final = "code-mode host cannot enforce heap limits"


def execution_id_reused(execution_id: str) -> str:
    """§12.1 ``ALREADY_EXISTS`` "code-mode execution ID `⟨id⟩` was reused"."""
    return f"code-mode execution ID `{execution_id}` was reused"


def wait_id_reused(wait_id: str) -> str:
    """§8.1, §12.1 ``ALREADY_EXISTS`` "code-mode wait ID `⟨id⟩` was reused"."""
    return f"code-mode wait ID `{wait_id}` was reused"


def unknown_invocation(invocation_id: str) -> str:
    """§6.3, §12.1 ``NOT_FOUND`` "unknown code-mode tool invocation ⟨id⟩" (an id never issued)."""
    return f"unknown code-mode tool invocation {invocation_id}"


def tool_output_not_json(detail: str) -> str:
    """``INVALID_ARGUMENT`` of a ``CompleteToolCall`` whose ``output_json`` is not strict JSON:
    "invalid code-mode tool output JSON: ⟨detail⟩" (upstream's; ⟨detail⟩ is this project's)."""
    return f"invalid code-mode tool output JSON: {detail}"


#: ``INVALID_ARGUMENT`` of a ``CompleteToolCall`` without ``succeeded``/``failed`` (upstream's).
TOOL_COMPLETION_MISSING_OUTCOME: Final = "tool completion is missing its outcome"
#: ``INVALID_ARGUMENT`` of a ``YieldObservation`` without ``observation`` (upstream's).
MISSING_OBSERVATION_ID: Final = "missing code-mode observation ID"

#: §12.1 ``CANCELLED`` "code-mode session is closed".
SESSION_IS_CLOSED: Final = "code-mode session is closed"
#: §8.2, §12.1 ``CANCELLED`` "code-mode wait was cancelled".
WAIT_WAS_CANCELLED: Final = "code-mode wait was cancelled"
#: §5, §12.1 ``CANCELLED`` "code-mode execution was abandoned".
EXECUTION_WAS_ABANDONED: Final = "code-mode execution was abandoned"
#: §12.1 ``RESOURCE_EXHAUSTED`` "code-mode host has too many open sessions".
HOST_TOO_MANY_OPEN_SESSIONS: Final = "code-mode host has too many open sessions"
#: §11, §12.1 ``RESOURCE_EXHAUSTED`` "code-mode host has too many in-flight requests".
HOST_TOO_MANY_IN_FLIGHT_REQUESTS: Final = "code-mode host has too many in-flight requests"
#: §11, §12.1 ``RESOURCE_EXHAUSTED`` "code-mode host has too many active cells".
HOST_TOO_MANY_ACTIVE_CELLS: Final = "code-mode host has too many active cells"
#: ``RESOURCE_EXHAUSTED`` of a ``SubscribeToToolCalls`` past ``MAX_SUBSCRIPTIONS_PER_SESSION``
#: (this project's: §11 sets no bound on a session's subscriptions).
SESSION_TOO_MANY_SUBSCRIPTIONS: Final = "code-mode session has too many tool subscriptions"
#: ``RESOURCE_EXHAUSTED`` of a ``SubscribeToToolCalls`` whose ``tool_names`` would take the
#: session's open subscriptions past ``MAX_SUBSCRIBED_TOOL_NAMES`` (this project's: §6.1 sets no
#: bound on a filter).
SESSION_TOO_MANY_SUBSCRIBED_TOOLS: Final = (
    "code-mode session's tool subscriptions name too many tools"
)
#: §4.1, §12.1 ``DEADLINE_EXCEEDED`` "timed out shutting down code-mode gRPC session".
SESSION_SHUTDOWN_TIMED_OUT: Final = "timed out shutting down code-mode gRPC session"
#: ``UNAVAILABLE`` for new sessions and executions while the host drains (this project's).
HOST_SHUTTING_DOWN: Final = "code-mode host is shutting down"

# -- the client (client side, §4, §5, §6, §7, §12.2, §13) ---------------------------------------------

#: §13.2 "gRPC code-mode session lease ended before opening".
LEASE_ENDED_BEFORE_OPENING: Final = "gRPC code-mode session lease ended before opening"
#: §13.2 "gRPC code-mode session lease omitted its opening event".
LEASE_OMITTED_OPENING: Final = "gRPC code-mode session lease omitted its opening event"
#: §4.2 "gRPC code-mode host repeated the session opening event" (fails the session).
LEASE_REPEATED_OPENING: Final = "gRPC code-mode host repeated the session opening event"
#: §4.2 "gRPC code-mode host sent an empty session event" (fails the session).
LEASE_EMPTY_EVENT: Final = "gRPC code-mode host sent an empty session event"
#: §4.1, §13.7: the lease ended while the client did not ask for shutdown (this project's wording,
#: the twin of the subscription's §6.1 text).
LEASE_CLOSED_UNEXPECTEDLY: Final = "gRPC code-mode session lease closed unexpectedly"
#: §6.1 "gRPC code-mode tool subscription closed unexpectedly".
SUBSCRIPTION_CLOSED_UNEXPECTEDLY: Final = "gRPC code-mode tool subscription closed unexpectedly"
#: §13.7 a later call on a stopped session with no recorded reason.
GRPC_SESSION_IS_CLOSED: Final = "code-mode gRPC session is closed"
#: §13.3 a request racing with a session that has already stopped.
GRPC_SESSION_CLOSED: Final = "gRPC code-mode session closed"

#: §13.8 what an ``execute`` or ``wait`` created before a reconnect fails with (the model reads it).
RUNTIME_REPLACED: Final = (
    "The exec runtime was replaced. Stored values and running cells were lost. Prior external "
    "tool operations may have completed; inspect their results before retrying. You may continue "
    "with a fresh exec call."
)
#: §13.8 a cell id that does not belong to the current generation.
STALE_GENERATION: Final = "cell belongs to a stale code-mode host generation"

#: §5 "gRPC code-mode execution ended before its starting event".
EXECUTION_ENDED_BEFORE_STARTING: Final = "gRPC code-mode execution ended before its starting event"
#: §5 "gRPC code-mode execution omitted its starting event".
EXECUTION_OMITTED_STARTING: Final = "gRPC code-mode execution omitted its starting event"
#: §5 "gRPC code-mode execution omitted its initial outcome".
EXECUTION_OMITTED_INITIAL_OUTCOME: Final = "gRPC code-mode execution omitted its initial outcome"
#: §5 "gRPC code-mode execution returned an unexpected event".
EXECUTION_UNEXPECTED_EVENT: Final = "gRPC code-mode execution returned an unexpected event"


def execution_returned_id(got: str, sent: str) -> str:
    """§5 "gRPC code-mode execution returned ID ⟨got⟩ instead of ⟨sent⟩" (fails the session)."""
    return f"gRPC code-mode execution returned ID {got} instead of {sent}"


def execution_returned_cell(got: str, expected: str) -> str:
    """§5 "gRPC code-mode execution returned cell ⟨got⟩ instead of ⟨expected⟩" (fails the session)."""
    return f"gRPC code-mode execution returned cell {got} instead of {expected}"


def host_returned_cell(got: str, expected: str) -> str:
    """§13.4 "gRPC code-mode host returned cell ⟨a⟩ instead of ⟨b⟩" (wait/terminate outcomes)."""
    return f"gRPC code-mode host returned cell {got} instead of {expected}"


def tool_call_wrong_session(got: str, expected: str) -> str:
    """§6.2 "gRPC code-mode tool invocation belongs to session ⟨got⟩ instead of ⟨expected⟩"."""
    return f"gRPC code-mode tool invocation belongs to session {got} instead of {expected}"


def cell_is_closed(cell_id: str) -> str:
    """§6.5 "code-mode cell ⟨cell_id⟩ is closed": the answer to a ToolCall of a closed execution."""
    return f"code-mode cell {cell_id} is closed"


#: §13.4 "code-mode tool invocation ID was reused" (fails the session).
INVOCATION_ID_REUSED: Final = "code-mode tool invocation ID was reused"
#: §7 "code-mode notification call ID does not match its execution" (fails the session).
NOTIFICATION_CALL_ID_MISMATCH: Final = "code-mode notification call ID does not match its execution"
#: §13.4 "code-mode execution ID was empty or reused".
EXECUTION_ID_EMPTY_OR_REUSED: Final = "code-mode execution ID was empty or reused"


def notification_delegate_failed(error: str) -> str:
    """§7 "code-mode notification delegate failed: ⟨error⟩" (logged, never fails the session)."""
    return f"code-mode notification delegate failed: {error}"


def execution_started_twice(execution_id: str) -> str:
    """§13.4 "code-mode execution ⟨id⟩ started twice"."""
    return f"code-mode execution {execution_id} started twice"


def execution_changed_cell(old: str, new: str) -> str:
    """§13.4 "code-mode execution changed cell ID from ⟨a⟩ to ⟨b⟩"."""
    return f"code-mode execution changed cell ID from {old} to {new}"


def host_reused_cell(cell_id: str) -> str:
    """§13.4 "code-mode host reused active cell ID ⟨id⟩"."""
    return f"code-mode host reused active cell ID {cell_id}"


def invalid_closure(cell_id: str) -> str:
    """§13.4 "code-mode host returned an invalid closure for cell ⟨id⟩" (a second CellClosed)."""
    return f"code-mode host returned an invalid closure for cell {cell_id}"


def wait_retire_failed(error: str) -> str:
    """§13.5 "failed to retire canceled gRPC code-mode wait: ⟨error⟩"."""
    return f"failed to retire canceled gRPC code-mode wait: {error}"


#: §12.2 the bound of a status error text, in UTF-8 bytes (cut texts end with ``...``).
MAX_STATUS_ERROR_BYTES: Final = 512


def bounded_error_text(text: str) -> str:
    """§12.2 ``text`` cut on a UTF-8 boundary to at most 512 bytes, ending ``...`` when cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_STATUS_ERROR_BYTES:
        return text
    return data[: MAX_STATUS_ERROR_BYTES - 3].decode("utf-8", "ignore") + "..."


def operation_failed(operation: str, code_name: str, message: str) -> str:
    """§12.2 "gRPC code-mode ⟨operation⟩ failed: ⟨CODE_NAME⟩: ⟨message⟩" (at most 512 bytes)."""
    return bounded_error_text(f"gRPC code-mode {operation} failed: {code_name}: {message}")


def timed_out_waiting(operation: str) -> str:
    """§13.3 "gRPC code-mode host timed out waiting for ⟨operation⟩ response"."""
    return f"gRPC code-mode host timed out waiting for {operation} response"


def invalid_endpoint(detail: str) -> str:
    """§13.1 "invalid gRPC code-mode host endpoint: ⟨detail⟩"."""
    return f"invalid gRPC code-mode host endpoint: {detail}"


#: §13.1 ⟨detail⟩ of an endpoint with a user or password (never repeats them).
ENDPOINT_HAS_CREDENTIALS: Final = "the endpoint must not include credentials"


def connect_failed(detail: str) -> str:
    """§13.1 "failed to connect to gRPC code-mode host: ⟨detail⟩"."""
    return f"failed to connect to gRPC code-mode host: {detail}"
