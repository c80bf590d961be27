"""What the V1 machines tell their glue (``protocol-v1.md`` §8, §9).

:class:`~codemode.protocol.v1.client.ClientProtocol` and
:class:`~codemode.protocol.v1.host.HostProtocol` return these from ``events_received()``; the
bytes to write come separately from ``data_to_send()``. Events carry domain values, never wire
messages: the glue acts on them without knowing the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from codemode.protocol.delegation import CallbackResult
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)
from codemode.protocol.v1.codec import LargePayload
from codemode.protocol.v1.handshake import Negotiated

__all__ = [
    "CallbackCancelled",
    "CallbackRequested",
    "CallbackResolved",
    "CancelOperation",
    "CellClosed",
    "CellStarted",
    "ClientEvent",
    "ConnectionEnded",
    "HandshakeComplete",
    "HostEvent",
    "InitialResponse",
    "LargeFrame",
    "NotificationCallback",
    "OpenSession",
    "OperationFailed",
    "SessionForgotten",
    "SessionOpened",
    "SessionShutDown",
    "StartExecute",
    "StartShutdown",
    "StartTerminate",
    "StartWait",
    "ToolCallback",
    "WaitAnswered",
]


# -- both ends ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandshakeComplete:
    """The handshake succeeded with this grant. On a dual connection the client glue opens the
    bulk socket now (and reports :meth:`~codemode.protocol.v1.client.ClientProtocol.bulk_opened`);
    the host glue expects one at ``negotiated.bulk_connection_token``."""

    negotiated: Negotiated


@dataclass(frozen=True, slots=True)
class ConnectionEnded:
    """The connection is over: write what ``data_to_send()`` still holds, then close.

    ``reason`` is the first failure (``None`` after a clean end); later failures never replace
    it. On the host, ``requests`` are the operations still running, for the glue to stop.
    """

    reason: str | None
    requests: tuple[int, ...] = ()


# -- client side --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionOpened:
    """``session/open`` request ``request_id`` succeeded."""

    request_id: int
    session_id: str


@dataclass(frozen=True, slots=True)
class CellStarted:
    """Execute ``request_id`` was admitted as ``cell_id``; its initial response comes later."""

    request_id: int
    session_id: str
    cell_id: CellId


@dataclass(frozen=True, slots=True)
class InitialResponse:
    """The first outcome of the cell admitted by execute ``request_id``."""

    request_id: int
    response: RuntimeResponse


@dataclass(frozen=True, slots=True)
class WaitAnswered:
    """Wait or terminate ``request_id`` completed with ``outcome``."""

    request_id: int
    outcome: WaitOutcome


@dataclass(frozen=True, slots=True)
class SessionShutDown:
    """Shutdown ``request_id`` finished: ``session/closed`` arrived and every cell was released."""

    request_id: int
    session_id: str


@dataclass(frozen=True, slots=True)
class OperationFailed:
    """Request ``request_id`` (its current phase) failed with ``message``.

    ``connection_lost`` is true when ``message`` is the connection's failure reason.
    """

    request_id: int
    message: str
    connection_lost: bool = False


@dataclass(frozen=True, slots=True)
class ToolCallback:
    """A nested tool call to run with ``delegate.invoke_tool``."""

    invocation: CodeModeNestedToolCall


@dataclass(frozen=True, slots=True)
class NotificationCallback:
    """A ``notify(...)`` text to deliver with ``delegate.notify``."""

    call_id: str
    cell_id: CellId
    text: str


@dataclass(frozen=True, slots=True)
class CallbackRequested:
    """Run callback ``delegate_id`` for ``session_id``; report its end with
    :meth:`~codemode.protocol.v1.client.ClientProtocol.finish_callback`."""

    delegate_id: int
    session_id: str
    callback: ToolCallback | NotificationCallback


@dataclass(frozen=True, slots=True)
class CallbackCancelled:
    """Set the cancellation token of callback ``delegate_id`` (its answer will be suppressed)."""

    delegate_id: int


@dataclass(frozen=True, slots=True)
class CellClosed:
    """Call ``delegate.cell_closed(cell_id)`` of ``session_id`` (exactly once per admitted cell)."""

    session_id: str
    cell_id: CellId


@dataclass(frozen=True, slots=True)
class SessionForgotten:
    """The machine no longer tracks ``session_id`` (open refused, or shut down)."""

    session_id: str


ClientEvent: TypeAlias = (
    HandshakeComplete
    | SessionOpened
    | CellStarted
    | InitialResponse
    | WaitAnswered
    | SessionShutDown
    | OperationFailed
    | CallbackRequested
    | CallbackCancelled
    | CellClosed
    | SessionForgotten
    | ConnectionEnded
)


# -- host side ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenSession:
    """Create a session; report ``session_opened`` or ``operation_failed``."""

    request_id: int
    session_id: str
    limits: CodeModeSessionCellExecutionLimits


@dataclass(frozen=True, slots=True)
class StartExecute:
    """Admit a cell; report ``execution_started`` then ``initial_response`` (or a failure)."""

    request_id: int
    session_id: str
    request: ExecuteRequest


@dataclass(frozen=True, slots=True)
class StartWait:
    """Observe a cell; report ``wait_completed`` or ``operation_failed``."""

    request_id: int
    session_id: str
    request: WaitRequest


@dataclass(frozen=True, slots=True)
class StartTerminate:
    """Terminate a cell; report ``wait_completed`` or ``operation_failed``."""

    request_id: int
    session_id: str
    cell_id: CellId


@dataclass(frozen=True, slots=True)
class StartShutdown:
    """Shut a session down; report ``session_shut_down``."""

    request_id: int
    session_id: str


@dataclass(frozen=True, slots=True)
class CancelOperation:
    """The client abandoned an execute before admission, or a wait: stop it, then report
    ``operation_failed(request_id, REQUEST_CANCELLED)`` unless its answer was already reported."""

    request_id: int


@dataclass(frozen=True, slots=True)
class CallbackResolved:
    """Callback ``delegate_id`` (a tool call or notification the host issued) ended."""

    delegate_id: int
    result: CallbackResult


@dataclass(frozen=True, slots=True)
class LargeFrame:
    """A frame of the client's too large to decode here (``HostProtocol(large_frames_apart=True)``):
    decode ``payload`` (:meth:`~codemode.protocol.v1.codec.LargePayload.decode`, on a worker
    thread) and report the message or its ``FrameError`` with ``receive_decoded``. Until then the
    machine takes in nothing more (what arrives is held): stop reading meanwhile."""

    payload: LargePayload[Any]


HostEvent: TypeAlias = (
    HandshakeComplete
    | OpenSession
    | StartExecute
    | StartWait
    | StartTerminate
    | StartShutdown
    | CancelOperation
    | CallbackResolved
    | LargeFrame
    | ConnectionEnded
)
