"""The V1 client connection state machine (``protocol-v1.md`` §9), sans-I/O.

:class:`ClientConnection` owns every piece of client-side bookkeeping of one V1 connection:
request ids, the pending-request table, sessions and their live cells, wait deferral, delegate
callback ids (parking, the pending cap, revocation) and the first failure reason. It never touches
a socket or an event loop, like h11's ``Connection``:

* methods that start or cancel operations return the frames to send (:class:`Send`);
* :meth:`ClientConnection.receive` takes one decoded host message and returns the events to act on;
* a host that breaks the protocol makes :meth:`~ClientConnection.receive` raise
  :class:`~codemode.errors.ProtocolError` carrying the exact connection-error text (Appendix B,
  K5-K19). The driver then calls :meth:`~ClientConnection.fail` with that text, which fails every
  pending call and revokes every callback.

Every message the machine produces is already encoded (``Send.frame``) and tagged with the lane
§7.3 requires (``Send.lane``); single-socket carriers ignore the lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Final, TypeAlias

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    FrameError,
    FrameErrorKind,
    ProtocolError,
)
from codemode.protocol.constants import I64_MAX, MAX_PENDING_DELEGATE_CALLS
from codemode.protocol.session import (
    DELEGATE_TASK_CANCELLED,
    SESSION_SHUTTING_DOWN,
    delegate_result_not_json,
    delegate_task_failed,
)
from codemode.protocol.strict_json import non_finite_number
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)
from codemode.protocol.v1.codec import encode_frame
from codemode.protocol.v1.conversions import (
    execute_request_to_wire,
    limits_to_wire,
    nested_tool_call_to_domain,
    runtime_response_to_domain,
    wait_outcome_to_domain,
    wait_request_to_wire,
)
from codemode.protocol.v1.handshake import Negotiated
from codemode.protocol.v1.lanes import Lane, lane_of
from codemode.protocol.v1.messages import (
    UNSET,
    CellClosed,
    ClientToHost,
    ConnectionReady,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostRequest,
    HostToClient,
    NotificationDelivered,
    NotificationSend,
    OperationCancel,
    OperationRequest,
    OperationResponse,
    SessionClosed,
    SessionExecute,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    SessionTerminate,
    SessionWait,
    ToolInvoke,
    ToolResult,
    UnsetType,
    WaitCompleted,
    WireError,
    WireOk,
    WireSessionCellExecutionLimits,
    WireWaitRequest,
    message_type,
)
from codemode.protocol.v1.recent import RecentIds

__all__ = [
    "CALLBACK_TASK_CANCELLED",
    "CONNECTION_CLOSED",
    "LIMITS_NOT_NEGOTIATED",
    "SECOND_HANDSHAKE_RESPONSE",
    "SESSION_CLOSED_DURING_EXECUTE",
    "CallbackCancelled",
    "CallbackFailed",
    "CallbackRequested",
    "CallbackResult",
    "CellClosedEvent",
    "ClientConnection",
    "ConnectionFailed",
    "Event",
    "ExecutionStartedEvent",
    "InitialResponse",
    "NotificationAccepted",
    "NotificationCallback",
    "OperationFailed",
    "ProtocolError",
    "Send",
    "SessionForgotten",
    "SessionOpened",
    "SessionShutDown",
    "ToolCallback",
    "ToolReturned",
    "WaitAnswered",
    "delegate_failed",
    "exited_with_status",
    "message_type",
    "not_json",
    "read_failed",
    "response_too_large",
    "write_failed",
    "wrong_lane",
]

# -- exact texts (Appendix B) ---------------------------------------------------------------------

#: K1: the host closed the connection.
CONNECTION_CLOSED: Final = "code-mode host connection closed"
#: K5
SECOND_HANDSHAKE_RESPONSE: Final = "code-mode host sent a second handshake response"
#: C7
LIMITS_NOT_NEGOTIATED: Final = (
    "code-mode host does not support session resource limits: "
    "missing `session-cell-execution-resource-limits` capability"
)
#: C10
SESSION_CLOSED_DURING_EXECUTE: Final = "code-mode session closed during execute"
#: What a delegate task that was itself cancelled answers (the embedded runtime's wording).
CALLBACK_TASK_CANCELLED: Final = DELEGATE_TASK_CANCELLED

_K8: Final = "code-mode host returned unknown request ID {}"
_K9: Final = "code-mode host returned an invalid open-session response"
_K10: Final = "code-mode host returned an invalid execute response"
_K11: Final = "code-mode host returned an invalid cell response"
_K12: Final = "code-mode host returned an invalid shutdown response"
_K13: Final = "code-mode host failed to shut down session {}: {}"
_K14: Final = "code-mode host returned cell {} for request targeting {}"
_K15: Final = "code-mode host returned an initial response for cell {} instead of {}"
_K16: Final = "code-mode host reused live cell ID in session {}"
_K17: Final = "duplicate code-mode delegate request ID {}"
_K18: Final = "code-mode host closed unknown cell {} in session {}"
_K19: Final = "code-mode host request ID space exhausted"
_D1: Final = (
    f"code-mode host exceeded the limit of {MAX_PENDING_DELEGATE_CALLS} pending delegate calls"
)
_D2: Final = "code-mode host delegated for unknown session {}"
_D3: Final = "code-mode host delegated for unknown cell {} in session {}"
_ENCODE_PREFIX: Final = "failed to encode code-mode IPC frame: "


def exited_with_status(status: object) -> str:
    """K2: the host process exited (``status`` is its exit status)."""
    return f"code-mode host exited with status {status}"


def read_failed(detail: str) -> str:
    """K3: reading a host message failed."""
    return f"failed to read code-mode host message: {detail}"


def write_failed(detail: str) -> str:
    """K4: writing a message to the host failed."""
    return f"failed to write code-mode host message: {detail}"


def wrong_lane(message_type: str, lane: Lane) -> str:
    """K6: the host sent a message on the wrong socket of a dual connection."""
    return f"code-mode host sent {message_type} on the {Lane(lane).value} socket"


# The D4/D5 texts are carrier-neutral: the embedded runtime answers with the same ones.
delegate_failed = delegate_task_failed
not_json = delegate_result_not_json


def response_too_large(detail: str) -> str:
    """D6: the delegate's response does not fit in one frame."""
    return f"code-mode delegate response exceeds the IPC frame limit: {detail}"


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Write ``frame`` (the encoded ``message``) on ``lane``."""

    message: ClientToHost
    frame: bytes | bytearray = field(repr=False)
    lane: Lane


@dataclass(frozen=True, slots=True)
class SessionOpened:
    """``session/open`` request ``request_id`` succeeded."""

    request_id: int
    session_id: str


@dataclass(frozen=True, slots=True)
class ExecutionStartedEvent:
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
    """Run callback ``delegate_id`` for ``session_id`` as its own task; report with
    :meth:`ClientConnection.finish_callback`."""

    delegate_id: int
    session_id: str
    callback: ToolCallback | NotificationCallback


@dataclass(frozen=True, slots=True)
class CallbackCancelled:
    """Set the cancellation token of callback ``delegate_id`` (its answer will be suppressed)."""

    delegate_id: int


@dataclass(frozen=True, slots=True)
class CellClosedEvent:
    """Call ``delegate.cell_closed(cell_id)`` of ``session_id`` (exactly once per admitted cell)."""

    session_id: str
    cell_id: CellId


@dataclass(frozen=True, slots=True)
class SessionForgotten:
    """The machine no longer tracks ``session_id`` (open refused, or shut down)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class ConnectionFailed:
    """The connection is dead; ``reason`` is the first failure (later failures never replace it)."""

    reason: str


Event: TypeAlias = (
    Send
    | SessionOpened
    | ExecutionStartedEvent
    | InitialResponse
    | WaitAnswered
    | SessionShutDown
    | OperationFailed
    | CallbackRequested
    | CallbackCancelled
    | CellClosedEvent
    | SessionForgotten
    | ConnectionFailed
)


# -- callback results (driver → machine) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolReturned:
    """``invoke_tool`` returned ``value``."""

    value: JSON


@dataclass(frozen=True, slots=True)
class NotificationAccepted:
    """``notify`` returned."""


@dataclass(frozen=True, slots=True)
class CallbackFailed:
    """The callback failed; ``message`` goes back to the host unchanged."""

    message: str


CallbackResult: TypeAlias = ToolReturned | NotificationAccepted | CallbackFailed


# -- internal records ----------------------------------------------------------------------------


class _Kind(Enum):
    OPEN = "open"
    EXECUTE = "execute"
    WAIT = "wait"
    TERMINATE = "terminate"
    SHUTDOWN = "shutdown"


class _SessionState(Enum):
    OPENING = "opening"
    OPEN = "open"
    SHUTTING_DOWN = "shutting down"


class _CallbackState(Enum):
    PARKED = "parked"  # waiting for its cell's execution/started
    RUNNING = "running"  # the delegate task runs; its answer will be sent
    REVOKED = "revoked"  # the task still runs, but its answer is suppressed


@dataclass(eq=False, slots=True)
class _Session:
    id: str
    state: _SessionState = _SessionState.OPENING
    cells: dict[str, _Cell] = field(default_factory=dict)  # live: started, no cell/closed yet
    unreported: int = 0  # admitted cells whose cell_closed has not fired yet
    admitting: int = 0  # executes still waiting for their operation/response
    parked: dict[int, _Callback] = field(default_factory=dict)
    cancelled_waits: dict[str, set[int]] = field(default_factory=dict)
    queued_waits: dict[str, list[_Request]] = field(default_factory=dict)
    shutdown: _Request | None = None
    closed: bool = False  # session/closed arrived


@dataclass(eq=False, slots=True)
class _Cell:
    session: _Session
    id: str
    closed: bool = False
    abandoned: bool = False
    callbacks: set[int] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class _Request:
    id: int
    kind: _Kind
    session: _Session
    cell: str | None = None  # wait/terminate: the target; execute: the admitted cell
    cancelled: bool = False  # the caller is gone: answers are still validated, then discarded
    cancel_sent: bool = False
    started: bool = False  # execute: execution/started arrived
    queued: Send | None = None  # a deferred wait's frame, until it is sent


@dataclass(eq=False, slots=True)
class _Callback:
    id: int
    session: _Session
    cell_id: str
    callback: ToolCallback | NotificationCallback
    state: _CallbackState
    cell: _Cell | None = None


def _send(message: ClientToHost) -> Send:
    return Send(message, encode_frame(message), lane_of(message))


# -- the machine ---------------------------------------------------------------------------------


class ClientConnection:
    """Client-side bookkeeping of one V1 connection (§9), after a successful handshake.

    ``negotiated`` is the handshake's grant (it decides whether session limits may be sent).
    ``first_request_id`` exists for tests of id exhaustion.
    """

    def __init__(self, negotiated: Negotiated | None = None, *, first_request_id: int = 1) -> None:
        self._negotiated = negotiated or Negotiated(frozenset(), None)
        self._next_request_id = first_request_id
        self._next_session = 1
        self._requests: dict[int, _Request] = {}
        self._sessions: dict[str, _Session] = {}
        self._callbacks: dict[int, _Callback] = {}
        self._finished_callbacks: RecentIds[int] = RecentIds()
        self._unresolved = 0  # parked + running callbacks (what the 1024 cap counts)
        self._failure: str | None = None

    # -- inspection ------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """The recorded connection failure reason, or ``None`` while alive."""
        return self._failure

    def is_alive(self) -> bool:
        """False once :meth:`fail` was called."""
        return self._failure is None

    @property
    def negotiated(self) -> Negotiated:
        """What the handshake granted."""
        return self._negotiated

    def open_cells(self, session_id: str) -> int:
        """Cells of ``session_id`` whose ``cell_closed`` has not fired yet."""
        session = self._sessions.get(session_id)
        return 0 if session is None else session.unreported

    def pending_requests(self) -> int:
        """Requests awaiting an answer (including locally queued waits)."""
        return len(self._requests)

    def unresolved_callbacks(self) -> int:
        """Parked and running callbacks whose answer the host still expects."""
        return self._unresolved

    # -- operations (caller → host) --------------------------------------------------------------

    def open_session(
        self, limits: CodeModeSessionCellExecutionLimits | None = None
    ) -> tuple[int, str, list[Send]]:
        """Start ``session/open`` for a fresh session id; returns ``(request_id, session_id, sends)``.

        Raises :class:`CodeModeError` C7 when non-default ``limits`` were not negotiated, and the
        conversion error (X1) when they do not fit the wire.
        """
        self._check_alive()
        wire_limits: WireSessionCellExecutionLimits | UnsetType = UNSET
        if limits is not None and not limits.is_default:
            if not self._negotiated.resource_limits:
                raise CodeModeError(LIMITS_NOT_NEGOTIATED)
            wire_limits = limits_to_wire(limits)
        session_id = f"session-{self._next_session}"
        request_id, send = self._request(SessionOpen(session_id, wire_limits))
        self._next_session += 1
        session = _Session(session_id)
        self._sessions[session_id] = session
        self._requests[request_id] = _Request(request_id, _Kind.OPEN, session)
        return request_id, session_id, [send]

    def execute(self, session_id: str, request: ExecuteRequest) -> tuple[int, list[Send]]:
        """Start ``session/execute``; the answers arrive as :class:`ExecutionStartedEvent` and
        :class:`InitialResponse` (or :class:`OperationFailed`)."""
        session = self._usable_session(session_id)
        wire = execute_request_to_wire(request)
        request_id, send = self._request(SessionExecute(session_id, wire))
        session.admitting += 1
        self._requests[request_id] = _Request(request_id, _Kind.EXECUTE, session)
        return request_id, [send]

    def wait(self, session_id: str, request: WaitRequest) -> tuple[int, list[Send]]:
        """Start ``session/wait``. While a cancelled wait for the same cell is unanswered the
        request is queued locally and ``sends`` is empty (§9.4); it goes out later as a
        :class:`Send` event."""
        session = self._usable_session(session_id)
        wire: WireWaitRequest = wait_request_to_wire(request)
        request_id, send = self._request(SessionWait(session_id, wire))
        cell = wire.cell_id
        entry = _Request(request_id, _Kind.WAIT, session, cell)
        self._requests[request_id] = entry
        if session.cancelled_waits.get(cell):
            entry.queued = send
            session.queued_waits.setdefault(cell, []).append(entry)
            return request_id, []
        return request_id, [send]

    def terminate(self, session_id: str, cell_id: CellId) -> tuple[int, list[Send]]:
        """Start ``session/terminate`` (never cancelled on the wire)."""
        session = self._usable_session(session_id)
        request_id, send = self._request(SessionTerminate(session_id, cell_id.value))
        self._requests[request_id] = _Request(request_id, _Kind.TERMINATE, session, cell_id.value)
        return request_id, [send]

    def shutdown(self, session_id: str) -> tuple[int, list[Event]]:
        """Start ``session/shutdown``. Executes of the session still awaiting admission fail at
        once with C10 (and are cancelled on the wire). :class:`SessionShutDown` follows once
        ``session/closed`` arrived and every cell's ``cell_closed`` fired."""
        session = self._usable_session(session_id)
        request_id, send = self._request(SessionShutdown(session_id))
        session.state = _SessionState.SHUTTING_DOWN
        entry = _Request(request_id, _Kind.SHUTDOWN, session)
        session.shutdown = entry
        events: list[Event] = [send]
        for other in list(self._requests.values()):
            if other.session is session and other.kind is _Kind.EXECUTE and not other.started:
                if not other.cancelled:
                    events.append(OperationFailed(other.id, SESSION_CLOSED_DURING_EXECUTE))
                other.cancelled = True
                events += self._cancel_on_wire(other)
        self._requests[request_id] = entry
        return request_id, events

    def cancel(self, request_id: int) -> list[Send]:
        """The caller of ``request_id`` went away (§1.5, §9.3-§9.5); returns what to send.

        open: the answer is discarded (a late ``session/ready`` is shut down at once); execute:
        ``operation/cancel`` once, and a ``session/terminate`` if the cell was admitted; wait:
        ``operation/cancel`` once, or a queued wait is dropped unsent; terminate and shutdown:
        the answer is discarded. Unknown or finished ids are ignored.
        """
        entry = self._requests.get(request_id)
        if entry is None or entry.cancelled:
            return []
        if entry.kind is _Kind.WAIT and entry.queued is not None:
            del self._requests[request_id]
            assert entry.cell is not None
            queue = entry.session.queued_waits[entry.cell]
            queue.remove(entry)
            if not queue:
                del entry.session.queued_waits[entry.cell]
            return []
        entry.cancelled = True
        if entry.kind is _Kind.EXECUTE:
            sends = self._cancel_on_wire(entry)
            if entry.started:
                cell = entry.session.cells.get(entry.cell or "")
                if cell is not None:
                    sends += self._terminate_abandoned(cell)
            return sends
        if entry.kind is _Kind.WAIT:
            assert entry.cell is not None
            entry.session.cancelled_waits.setdefault(entry.cell, set()).add(request_id)
            return self._cancel_on_wire(entry)
        return []

    def abandon_cell(self, session_id: str, cell_id: CellId, request_id: int) -> list[Send]:
        """A :class:`StartedCell` was abandoned after admission (§9.3 step 4): cancel its execute
        if the initial response is still pending, and terminate the cell unless it is closed or
        its session is shutting down. Idempotent."""
        sends: list[Send] = []
        entry = self._requests.get(request_id)
        if (
            entry is not None
            and entry.kind is _Kind.EXECUTE
            and entry.started
            and entry.cell == cell_id.value
        ):
            entry.cancelled = True
            sends += self._cancel_on_wire(entry)
        session = self._sessions.get(session_id)
        cell = None if session is None else session.cells.get(cell_id.value)
        if cell is not None:
            sends += self._terminate_abandoned(cell)
        return sends

    def finish_callback(self, delegate_id: int, result: CallbackResult) -> list[Event]:
        """Callback ``delegate_id``'s task ended with ``result``: the response to send (unless it
        was revoked), and ``cell_closed`` if this was the last task of a closed cell."""
        callback = self._callbacks.get(delegate_id)
        if callback is None or callback.state is _CallbackState.PARKED:
            raise KeyError(f"no running callback {delegate_id}")
        del self._callbacks[delegate_id]
        self._finished_callbacks.add(delegate_id)
        events: list[Event] = []
        if callback.state is _CallbackState.RUNNING:
            self._unresolved -= 1
            if self._failure is None:
                events.append(self._respond(delegate_id, callback.callback, result))
        cell = callback.cell
        assert cell is not None
        cell.callbacks.discard(delegate_id)
        if cell.closed and not cell.callbacks:
            events += self._report_closed(cell)
        return events

    def fail(self, reason: str) -> list[Event]:
        """Record the connection's death (§9.8); the first reason wins, later calls return ``[]``.

        Fails every pending call with ``reason``, revokes every running callback, drops parked
        ones, and closes every live cell (``cell_closed`` fires once its callbacks finished).
        """
        if self._failure is not None:
            return []
        self._failure = reason
        events: list[Event] = [ConnectionFailed(reason)]
        for entry in self._requests.values():
            if not entry.cancelled:
                events.append(OperationFailed(entry.id, reason, connection_lost=True))
        self._requests.clear()
        for delegate_id, callback in list(self._callbacks.items()):
            if callback.state is _CallbackState.PARKED:
                del self._callbacks[delegate_id]
        for session in list(self._sessions.values()):
            session.parked.clear()
            session.cancelled_waits.clear()
            session.queued_waits.clear()
            session.admitting = 0
            for cell in list(session.cells.values()):
                events += self._close_cell(cell)
        self._unresolved = 0
        return events

    # -- host messages ---------------------------------------------------------------------------

    def receive(self, message: HostToClient) -> list[Event]:
        """Process one host message; raise :class:`ProtocolError` for a connection error.

        Validation happens before any state changes, so a raised error leaves the bookkeeping
        intact for :meth:`fail`. Messages after :meth:`fail` are ignored.
        """
        if self._failure is not None:
            return []
        if isinstance(message, OperationResponse):
            return self._operation_response(message)
        if isinstance(message, ExecuteInitialResponse):
            return self._initial_response(message)
        if isinstance(message, DelegateRequestMessage):
            return self._delegate_request(message)
        if isinstance(message, DelegateCancel):
            return self._delegate_cancel(message.id)
        if isinstance(message, CellClosed):
            return self._cell_closed(message)
        if isinstance(message, ConnectionReady | ConnectionRejected):
            raise ProtocolError(SECOND_HANDSHAKE_RESPONSE)
        raise TypeError(f"not a host message: {message!r}")

    def _operation_response(self, message: OperationResponse) -> list[Event]:
        entry = self._requests.get(message.id)
        if (
            entry is None
            or entry.queued is not None
            or (entry.kind is _Kind.EXECUTE and entry.started)
        ):
            raise ProtocolError(_K8.format(message.id))
        result = message.result
        if entry.kind is _Kind.OPEN:
            return self._open_answered(entry, result)
        if entry.kind is _Kind.EXECUTE:
            return self._execute_answered(entry, result)
        if entry.kind is _Kind.SHUTDOWN:
            return self._shutdown_answered(entry, result)
        return self._cell_answered(entry, result)

    def _open_answered(self, entry: _Request, result: object) -> list[Event]:
        session = entry.session
        if isinstance(result, WireOk):
            value = result.value
            if not isinstance(value, SessionReady) or value.session_id != session.id:
                raise ProtocolError(_K9)
            del self._requests[entry.id]
            session.state = _SessionState.OPEN
            if entry.cancelled:
                # Nobody will ever use this session: close it on the host right away (§9.5).
                return self._internal_shutdown(session)
            return [SessionOpened(entry.id, session.id)]
        assert isinstance(result, WireError)
        del self._requests[entry.id]
        del self._sessions[session.id]
        events: list[Event] = [SessionForgotten(session.id)]
        if not entry.cancelled:
            events.insert(0, OperationFailed(entry.id, result.message))
        return events

    def _execute_answered(self, entry: _Request, result: object) -> list[Event]:
        session = entry.session
        events: list[Event] = []
        if isinstance(result, WireOk):
            value = result.value
            if not isinstance(value, ExecutionStarted):
                raise ProtocolError(_K10)
            if value.cell_id in session.cells:
                raise ProtocolError(_K16.format(session.id))
            session.admitting -= 1
            cell = _Cell(session, value.cell_id)
            session.cells[cell.id] = cell
            session.unreported += 1
            entry.started = True
            entry.cell = cell.id
            if entry.cancelled:
                events += self._terminate_abandoned(cell)
            else:
                events.append(ExecutionStartedEvent(entry.id, session.id, CellId(cell.id)))
            for parked in list(session.parked.values()):
                if parked.cell_id == cell.id:
                    del session.parked[parked.id]
                    events += self._start_callback(parked, cell, counted=True)
        else:
            assert isinstance(result, WireError)
            session.admitting -= 1
            del self._requests[entry.id]
            if not entry.cancelled:
                events.append(OperationFailed(entry.id, result.message))
        if session.admitting == 0:
            events += self._refuse_parked(session)
        return events

    def _cell_answered(self, entry: _Request, result: object) -> list[Event]:
        outcome: WaitOutcome | None = None
        if isinstance(result, WireOk):
            value = result.value
            if not isinstance(value, WaitCompleted):
                raise ProtocolError(_K11)
            got = value.outcome.response.body.cell_id
            if got != entry.cell:
                raise ProtocolError(_K14.format(got, entry.cell))
            outcome = wait_outcome_to_domain(value.outcome)
        del self._requests[entry.id]
        events: list[Event] = []
        if not entry.cancelled:
            if outcome is not None:
                events.append(WaitAnswered(entry.id, outcome))
            else:
                assert isinstance(result, WireError)
                events.append(OperationFailed(entry.id, result.message))
        if entry.kind is _Kind.WAIT and entry.cancelled:
            events += self._cancelled_wait_answered(entry)
        return events

    def _cancelled_wait_answered(self, entry: _Request) -> list[Event]:
        session, cell = entry.session, entry.cell
        assert cell is not None
        waiting = session.cancelled_waits.get(cell)
        if waiting is None:
            return []
        waiting.discard(entry.id)
        if waiting:
            return []
        del session.cancelled_waits[cell]
        # The last cancelled observation is gone: the deferred waits may go out now (§9.4).
        events: list[Event] = []
        for queued in session.queued_waits.pop(cell, []):
            assert queued.queued is not None
            events.append(queued.queued)
            queued.queued = None
        return events

    def _shutdown_answered(self, entry: _Request, result: object) -> list[Event]:
        session = entry.session
        if isinstance(result, WireError):
            raise ProtocolError(_K13.format(session.id, result.message))
        assert isinstance(result, WireOk)
        value = result.value
        if not isinstance(value, SessionClosed) or value.session_id != session.id:
            raise ProtocolError(_K12)
        del self._requests[entry.id]
        session.closed = True
        events: list[Event] = []
        for other in list(self._requests.values()):
            if other.session is session and other.kind is _Kind.EXECUTE and not other.cancelled:
                # The host sends every initial response before session/closed; if one is still
                # missing it will never come.
                other.cancelled = True
                events.append(OperationFailed(other.id, SESSION_CLOSED_DURING_EXECUTE))
        # The host closes every cell before session/closed (§8.3). Should it not have, the cells
        # are gone anyway: release them so that cell_closed still fires exactly once.
        for cell in list(session.cells.values()):
            events += self._close_cell(cell)
        events += self._maybe_shut_down(session)
        return events

    def _initial_response(self, message: ExecuteInitialResponse) -> list[Event]:
        entry = self._requests.get(message.id)
        if entry is None or entry.kind is not _Kind.EXECUTE or not entry.started:
            raise ProtocolError(_K8.format(message.id))
        result = message.result
        response: RuntimeResponse | None = None
        if isinstance(result, WireOk):
            got = result.value.body.cell_id
            if got != entry.cell:
                raise ProtocolError(_K15.format(got, entry.cell))
            response = runtime_response_to_domain(result.value)
        del self._requests[entry.id]
        if entry.cancelled:
            return []
        if response is not None:
            return [InitialResponse(entry.id, response)]
        assert isinstance(result, WireError)
        return [OperationFailed(entry.id, result.message)]

    # -- callbacks -------------------------------------------------------------------------------

    def _delegate_request(self, message: DelegateRequestMessage) -> list[Event]:
        delegate_id = message.id
        if delegate_id in self._callbacks or delegate_id in self._finished_callbacks:
            raise ProtocolError(_K17.format(delegate_id))
        if self._unresolved >= MAX_PENDING_DELEGATE_CALLS:
            return [self._refuse(delegate_id, _D1)]
        session = self._sessions.get(message.session_id)
        if session is None or session.state is _SessionState.OPENING or session.closed:
            return [self._refuse(delegate_id, _D2.format(message.session_id))]
        request = message.request
        callback: ToolCallback | NotificationCallback
        if isinstance(request, ToolInvoke):
            callback = ToolCallback(nested_tool_call_to_domain(request.invocation))
            cell_id = request.invocation.cell_id
        else:
            assert isinstance(request, NotificationSend)
            cell_id = request.cell_id
            callback = NotificationCallback(request.call_id, CellId(cell_id), request.text)
        pending = _Callback(delegate_id, session, cell_id, callback, _CallbackState.PARKED)
        cell = session.cells.get(cell_id)
        if cell is not None:
            return self._start_callback(pending, cell, counted=False)
        if session.admitting > 0:
            # On a dual connection a tool/invoke (bulk) may overtake its execution/started
            # (control): hold it until the cell appears or no execute is left to admit it.
            session.parked[delegate_id] = pending
            self._callbacks[delegate_id] = pending
            self._unresolved += 1
            return []
        return [self._refuse(delegate_id, _D3.format(cell_id, session.id))]

    def _start_callback(self, callback: _Callback, cell: _Cell, *, counted: bool) -> list[Event]:
        if not counted:
            self._unresolved += 1
        callback.state = _CallbackState.RUNNING
        callback.cell = cell
        cell.callbacks.add(callback.id)
        self._callbacks[callback.id] = callback
        return [CallbackRequested(callback.id, callback.session.id, callback.callback)]

    def _refuse_parked(self, session: _Session) -> list[Event]:
        events: list[Event] = []
        for parked in list(session.parked.values()):
            del session.parked[parked.id]
            del self._callbacks[parked.id]
            self._unresolved -= 1
            events.append(self._refuse(parked.id, _D3.format(parked.cell_id, session.id)))
        return events

    def _refuse(self, delegate_id: int, message: str) -> Send:
        self._finished_callbacks.add(delegate_id)
        return _send(DelegateResponseMessage(delegate_id, WireError(message)))

    def _delegate_cancel(self, delegate_id: int) -> list[Event]:
        callback = self._callbacks.get(delegate_id)
        if callback is None or callback.state is _CallbackState.REVOKED:
            return []  # unknown, finished or already revoked: nothing to do (§9.6, §7.3)
        self._unresolved -= 1
        if callback.state is _CallbackState.PARKED:
            del self._callbacks[delegate_id]
            del callback.session.parked[delegate_id]
            self._finished_callbacks.add(delegate_id)
            return []
        callback.state = _CallbackState.REVOKED
        return [CallbackCancelled(delegate_id)]

    def _respond(
        self,
        delegate_id: int,
        callback: ToolCallback | NotificationCallback,
        result: CallbackResult,
    ) -> Send:
        if isinstance(result, CallbackFailed):
            return _send(DelegateResponseMessage(delegate_id, WireError(result.message)))
        if isinstance(callback, NotificationCallback):
            return _send(DelegateResponseMessage(delegate_id, WireOk(NotificationDelivered())))
        value = result.value if isinstance(result, ToolReturned) else None
        try:
            send = _send(DelegateResponseMessage(delegate_id, WireOk(ToolResult(value))))
            if b"null" in send.frame and (number := non_finite_number(value)) is not None:
                text = not_json(f"{number} is not a JSON number")
                return _send(DelegateResponseMessage(delegate_id, WireError(text)))
            return send
        except FrameError as error:
            if error.kind is FrameErrorKind.OVERSIZE:
                text = response_too_large(error.message)
            else:
                text = not_json(error.message.removeprefix(_ENCODE_PREFIX))
            return _send(DelegateResponseMessage(delegate_id, WireError(text)))

    # -- cells and sessions ------------------------------------------------------------------------

    def _cell_closed(self, message: CellClosed) -> list[Event]:
        session = self._sessions.get(message.session_id)
        cell = None if session is None else session.cells.get(message.cell_id)
        if cell is None:
            raise ProtocolError(_K18.format(message.cell_id, message.session_id))
        return self._close_cell(cell)

    def _close_cell(self, cell: _Cell) -> list[Event]:
        del cell.session.cells[cell.id]
        cell.closed = True
        events: list[Event] = []
        for delegate_id in sorted(cell.callbacks):
            callback = self._callbacks[delegate_id]
            if callback.state is _CallbackState.RUNNING:
                callback.state = _CallbackState.REVOKED
                self._unresolved -= 1
                events.append(CallbackCancelled(delegate_id))
        if not cell.callbacks:
            events += self._report_closed(cell)
        return events

    def _report_closed(self, cell: _Cell) -> list[Event]:
        session = cell.session
        session.unreported -= 1
        events: list[Event] = [CellClosedEvent(session.id, CellId(cell.id))]
        return events + self._maybe_shut_down(session)

    def _maybe_shut_down(self, session: _Session) -> list[Event]:
        if (
            not session.closed
            or session.unreported
            or self._sessions.get(session.id) is not session
        ):
            return []
        del self._sessions[session.id]
        events: list[Event] = []
        shutdown = session.shutdown
        if shutdown is not None and not shutdown.cancelled:
            events.append(SessionShutDown(shutdown.id, session.id))
        events.append(SessionForgotten(session.id))
        return events

    def _terminate_abandoned(self, cell: _Cell) -> list[Send]:
        session = cell.session
        if cell.abandoned or cell.closed or session.state is not _SessionState.OPEN:
            return []
        cell.abandoned = True
        request_id, send = self._request(SessionTerminate(session.id, cell.id))
        self._requests[request_id] = _Request(
            request_id, _Kind.TERMINATE, session, cell.id, cancelled=True
        )
        return [send]

    def _internal_shutdown(self, session: _Session) -> list[Event]:
        request_id, send = self._request(SessionShutdown(session.id))
        session.state = _SessionState.SHUTTING_DOWN
        entry = _Request(request_id, _Kind.SHUTDOWN, session, cancelled=True)
        session.shutdown = entry
        self._requests[request_id] = entry
        return [send]

    # -- helpers ---------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ConnectionClosed(self._failure)

    def _usable_session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None or session.state is _SessionState.SHUTTING_DOWN:
            raise CodeModeError(SESSION_SHUTTING_DOWN)
        self._check_alive()
        if session.state is _SessionState.OPENING:
            raise KeyError(f"session {session_id} is not open yet")
        return session

    def _request(self, request: HostRequest) -> tuple[int, Send]:
        """Allocate the next request id and encode the request; nothing is committed on error."""
        request_id = self._next_request_id
        if request_id > I64_MAX:
            raise ProtocolError(_K19)
        send = _send(OperationRequest(request_id, request))
        self._next_request_id = request_id + 1
        return request_id, send

    def _cancel_on_wire(self, entry: _Request) -> list[Send]:
        if entry.cancel_sent or self._failure is not None:
            return []
        entry.cancel_sent = True
        return [_send(OperationCancel(entry.id))]
