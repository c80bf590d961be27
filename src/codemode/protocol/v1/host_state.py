"""The host end of a V1 connection as a sans-I/O state machine (``protocol-v1.md`` §3, §8).

:class:`HostConnection` takes decoded client messages and returns *actions*: messages to send and
operations for the glue to run on its sessions. The glue reports each operation's result back
(``session_opened``, ``execution_started``, …) and gets the messages to send in return. It never
touches a socket, so every rule here — duplicate ids, admission limits, cancellation, the
callback cap, the ordering of ``execution/started``, ``cell/closed`` and ``session/closed`` — is
testable without one.

Connection errors raise :class:`~codemode.errors.ProtocolError` carrying the exact log text
(L3-L6); operation problems are error answers, never connection errors.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, TypeAlias

from codemode.errors import ProtocolError, WireConversionError
from codemode.protocol.constants import (
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    MAX_PENDING_DELEGATE_CALLS,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)
from codemode.protocol.v1.conversions import (
    execute_request_to_domain,
    limits_to_domain,
    runtime_response_to_wire,
    wait_outcome_to_wire,
    wait_request_to_domain,
)
from codemode.protocol.v1.handshake import Negotiated, negotiate
from codemode.protocol.v1.messages import (
    UNSET,
    CellClosed,
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequest,
    DelegateRequestMessage,
    DelegateResponse,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostResponse,
    HostToClient,
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
    WaitCompleted,
    WireError,
    WireOk,
)
from codemode.protocol.v1.recent import RecentIds
from codemode.protocol.v1.revision import WireRevision

__all__ = [
    "CANCELLED",
    "CancelOperation",
    "HostAction",
    "HostConnection",
    "OpenSession",
    "ResolveCallback",
    "Send",
    "StartExecute",
    "StartShutdown",
    "StartTerminate",
    "StartWait",
]

CANCELLED: Final = "code-mode request cancelled"
TOO_MANY_REQUESTS: Final = "code-mode host has too many in-flight requests"
TOO_MANY_CELLS: Final = "code-mode host has too many active cells"
SHUTTING_DOWN: Final = "code-mode host is shutting down"
LIMITS_NOT_NEGOTIATED: Final = (
    "invalid code-mode session execution limits: capability "
    "`session-cell-execution-resource-limits` was not negotiated"
)


# -- actions ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Write this message to the client."""

    message: HostToClient


@dataclass(frozen=True, slots=True)
class OpenSession:
    """Create a session; report with ``session_opened`` or ``operation_failed``."""

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
    ``operation_failed(request_id, CANCELLED)`` unless its real answer was already reported."""

    request_id: int


@dataclass(frozen=True, slots=True)
class ResolveCallback:
    """The client answered callback ``delegate_id``."""

    delegate_id: int
    result: WireOk[DelegateResponse] | WireError


HostAction: TypeAlias = (
    Send
    | OpenSession
    | StartExecute
    | StartWait
    | StartTerminate
    | StartShutdown
    | CancelOperation
    | ResolveCallback
)


# -- bookkeeping -----------------------------------------------------------------------------------


class _Kind(Enum):
    OPEN = "open"
    EXECUTE = "execute"
    WAIT = "wait"
    TERMINATE = "terminate"
    SHUTDOWN = "shutdown"


@dataclass(slots=True)
class _Request:
    kind: _Kind
    session_id: str
    cell_id: str | None = None  # the cell its answer names (wait, terminate, started execute)
    admitted: bool = False  # execute: execution/started was sent
    cancelled: bool = False


@dataclass(slots=True)
class _Cell:
    announced: bool = False
    open_answers: int = 0  # in-flight answers that name this cell
    close_requested: bool = False
    early: list[DelegateRequestMessage] = field(default_factory=list)
    callbacks: set[int] = field(default_factory=set)


#: Unresolved-callback slots each session keeps for itself on a shared connection (a decision of
#: ours within §8.6's per-connection limit; docs/security.md).
SESSION_CALLBACK_RESERVE: Final = 64


@dataclass(slots=True)
class _Session:
    cells: dict[str, _Cell] = field(default_factory=dict)
    pending: int = 0  # this session's share of the connection's unresolved callbacks
    shutdown_request: int | None = None
    shut_down: bool = False


class HostConnection:
    """Bookkeeping and rules of one V1 connection, host side."""

    def __init__(
        self,
        *,
        capabilities: Iterable[str] = (SESSION_RESOURCE_LIMITS_CAPABILITY,),
        max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS,
        max_active_cells: int = DEFAULT_MAX_ACTIVE_CELLS,
        new_token: Callable[[], str] = lambda: secrets.token_urlsafe(24),
        wire_revision: WireRevision = WireRevision.PINNED,
    ) -> None:
        self._capabilities = frozenset(capabilities)
        #: The shape runtime responses are written in (``latest`` adds the timing fields).
        self.wire_revision = WireRevision(wire_revision)
        self._max_in_flight = max_in_flight_requests
        self._max_active_cells = max_active_cells
        self._new_token = new_token
        self.negotiated: Negotiated | None = None
        self._requests: dict[int, _Request] = {}
        self._finished: RecentIds[int] = RecentIds()
        self._sessions: dict[str, _Session] = {}  # open, plus shutting down until closed
        self._opened: RecentIds[str] = RecentIds()
        self._admitting = 0
        self._active_cells = 0
        self._next_delegate_id = 1
        self._callbacks: dict[int, tuple[str, str]] = {}  # delegate id -> (session, cell)
        self._revoked: RecentIds[int] = RecentIds()
        self._closing = False

    # -- handshake ----------------------------------------------------------------------------

    def negotiate(self, first: ClientToHost) -> ConnectionReady | ConnectionRejected:
        """Answer the client's first message (§3.3); the connection is open after a ready."""
        reply, granted = negotiate(first, self._capabilities, new_token=self._new_token)
        self.negotiated = granted
        return reply

    # -- client messages ------------------------------------------------------------------------

    def receive(self, message: ClientToHost) -> list[HostAction]:
        """Process one message from the client."""
        if isinstance(message, OperationRequest):
            return self._request(message)
        if isinstance(message, OperationCancel):
            return self._cancel(message.id)
        if isinstance(message, DelegateResponseMessage):
            return self._delegate_response(message)
        assert isinstance(message, ConnectionHello)
        raise ProtocolError("received a second code-mode client hello")

    def _request(self, message: OperationRequest) -> list[HostAction]:
        request_id, request = message.id, message.request
        if request_id in self._requests or request_id in self._finished:
            raise ProtocolError(f"duplicate code-mode request ID {request_id}")
        if len(self._requests) >= self._max_in_flight:
            return self._refuse(request_id, TOO_MANY_REQUESTS)
        if self._closing:
            return self._refuse(request_id, SHUTTING_DOWN)
        session_id = request.session_id
        if isinstance(request, SessionOpen):
            return self._open(request_id, request)
        if isinstance(request, SessionExecute):  # conversion comes before the session (§8.2)
            try:
                domain = execute_request_to_domain(request.request)
            except WireConversionError as error:
                return self._refuse(request_id, f"invalid code-mode execute request: {error}")
        session = self._sessions.get(session_id)
        if session is None or session.shutdown_request is not None:
            return self._refuse(request_id, f"unknown code-mode session {session_id}")
        if isinstance(request, SessionExecute):
            if self._active_cells + self._admitting >= self._max_active_cells:
                return self._refuse(request_id, TOO_MANY_CELLS)
            self._admitting += 1
            self._requests[request_id] = _Request(_Kind.EXECUTE, session_id)
            return [StartExecute(request_id, session_id, domain)]
        if isinstance(request, SessionWait):
            cell_id = request.request.cell_id
            self._track_answer(request_id, _Kind.WAIT, session, session_id, cell_id)
            return [StartWait(request_id, session_id, wait_request_to_domain(request.request))]
        if isinstance(request, SessionTerminate):
            self._track_answer(request_id, _Kind.TERMINATE, session, session_id, request.cell_id)
            return [StartTerminate(request_id, session_id, CellId(request.cell_id))]
        assert isinstance(request, SessionShutdown)
        session.shutdown_request = request_id
        self._requests[request_id] = _Request(_Kind.SHUTDOWN, session_id)
        return [StartShutdown(request_id, session_id)]

    def _open(self, request_id: int, request: SessionOpen) -> list[HostAction]:
        session_id = request.session_id
        wire_limits = request.cell_execution_limits
        if wire_limits is not UNSET and (
            self.negotiated is None or not self.negotiated.resource_limits
        ):
            return self._refuse(request_id, LIMITS_NOT_NEGOTIATED)
        existing = self._sessions.get(session_id)
        if existing is not None and existing.shutdown_request is None:
            return self._refuse(request_id, f"code-mode session ID `{session_id}` is already open")
        if existing is not None or session_id in self._opened:
            return self._refuse(request_id, f"code-mode session ID `{session_id}` was reused")
        self._opened.add(session_id)
        self._sessions[session_id] = _Session()
        limits = (
            CodeModeSessionCellExecutionLimits()
            if wire_limits is UNSET
            else limits_to_domain(wire_limits)
        )
        self._requests[request_id] = _Request(_Kind.OPEN, session_id)
        return [OpenSession(request_id, session_id, limits)]

    def _track_answer(
        self, request_id: int, kind: _Kind, session: _Session, session_id: str, cell_id: str
    ) -> None:
        cell = session.cells.get(cell_id)
        if cell is not None:
            cell.open_answers += 1
        # Only an answer counted on a known cell holds (and later releases) its cell/closed.
        self._requests[request_id] = _Request(kind, session_id, None if cell is None else cell_id)

    def _refuse(self, request_id: int, message: str) -> list[HostAction]:
        self._finished.add(request_id)
        return [Send(OperationResponse(request_id, WireError(message)))]

    def _cancel(self, request_id: int) -> list[HostAction]:
        request = self._requests.get(request_id)
        if request is None or request.cancelled:
            return []
        if request.kind is _Kind.WAIT or (request.kind is _Kind.EXECUTE and not request.admitted):
            request.cancelled = True
            return [CancelOperation(request_id)]
        return []  # open, terminate, shutdown and admitted executes are not cancellable

    def _delegate_response(self, message: DelegateResponseMessage) -> list[HostAction]:
        delegate_id = message.id
        owner = self._release(delegate_id)
        if owner is None:
            if delegate_id in self._revoked:
                return []  # the client answered a callback we had already revoked
            raise ProtocolError(
                f"code-mode client returned unknown delegate request ID {delegate_id}"
            )
        self._forget_callback(delegate_id, owner)
        return [ResolveCallback(delegate_id, message.result)]

    # -- results of the glue's operations ---------------------------------------------------------

    def in_flight(self, request_id: int) -> bool:
        """True while ``request_id`` has not received its last answer."""
        return request_id in self._requests

    def cancelled(self, request_id: int) -> bool:
        """True when the client cancelled ``request_id`` (and it may not be admitted any more)."""
        request = self._requests.get(request_id)
        return request is not None and request.cancelled

    def session_opened(self, request_id: int) -> list[Send]:
        """``session/open`` succeeded."""
        request = self._finish(request_id)
        if request is None:
            return []
        return [self._answer(request_id, SessionReady(request.session_id))]

    def operation_failed(self, request_id: int, message: str) -> list[Send]:
        """Answer ``request_id`` with an error (a failed open forgets the session again)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        if request.kind is _Kind.EXECUTE and request.admitted:
            return self.initial_response(request_id, None, message)
        self._finish(request_id)
        sends = [Send(OperationResponse(request_id, WireError(message)))]
        if request.kind is _Kind.OPEN:
            self._sessions.pop(request.session_id, None)
        elif request.kind is _Kind.EXECUTE:
            self._admitting -= 1
        sends += self._answered_cell(request)
        return sends

    def execution_started(self, request_id: int, cell_id: CellId) -> list[Send] | None:
        """The execute was admitted as ``cell_id``; ``None`` means it was cancelled first (the
        glue must abandon the cell and report ``operation_failed(request_id, CANCELLED)``)."""
        request = self._requests.get(request_id)
        if request is None or request.cancelled:
            return None
        request.admitted = True
        request.cell_id = str(cell_id)
        self._admitting -= 1
        self._active_cells += 1
        session = self._sessions[request.session_id]
        cell = session.cells.setdefault(str(cell_id), _Cell())
        cell.announced = True
        cell.open_answers += 1  # the initial response names it
        sends = [Send(OperationResponse(request_id, WireOk(ExecutionStarted(str(cell_id)))))]
        sends += [Send(message) for message in cell.early]
        cell.early.clear()
        return sends

    def initial_response(
        self, request_id: int, response: RuntimeResponse | None, error: str | None = None
    ) -> list[Send]:
        """The admitted cell's first outcome (or an error)."""
        request = self._finish(request_id)
        if request is None:
            return []
        result: WireOk[Any] | WireError
        result = (
            WireError(error or "")
            if response is None
            else WireOk(runtime_response_to_wire(response, self.wire_revision))
        )
        sends = [Send(ExecuteInitialResponse(request_id, result))]
        return sends + self._answered_cell(request)

    def wait_completed(self, request_id: int, outcome: WaitOutcome) -> list[Send]:
        """A wait or terminate finished with ``outcome``."""
        request = self._finish(request_id)
        if request is None:
            return []
        wire = wait_outcome_to_wire(outcome, self.wire_revision)
        sends = [self._answer(request_id, WaitCompleted(wire))]
        return sends + self._answered_cell(request)

    def session_shut_down(self, request_id: int) -> list[Send]:
        """The runtime finished shutting the session down; ``session/closed`` follows the last
        ``cell/closed`` of the session."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        session = self._sessions.get(request.session_id)
        if session is None:  # its open failed after the shutdown was accepted
            return self.operation_failed(
                request_id, f"unknown code-mode session {request.session_id}"
            )
        session.shut_down = True
        return self._maybe_session_closed(request.session_id, session)

    def _answer(self, request_id: int, value: HostResponse) -> Send:
        return Send(OperationResponse(request_id, WireOk(value)))

    def _finish(self, request_id: int) -> _Request | None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._finished.add(request_id)
        return request

    def _answered_cell(self, request: _Request) -> list[Send]:
        session = self._sessions.get(request.session_id)
        if session is None or request.cell_id is None:
            return []
        cell = session.cells.get(request.cell_id)
        if cell is None:
            return []
        cell.open_answers -= 1
        return self._maybe_cell_closed(request.session_id, session, request.cell_id, cell)

    # -- cells and callbacks -------------------------------------------------------------------------

    def cell_closed(self, session_id: str, cell_id: CellId) -> list[Send]:
        """The runtime retired a cell; ``cell/closed`` goes out once every answer naming the
        cell was sent and its callbacks are resolved or revoked."""
        session = self._sessions.get(session_id)
        if session is None:
            return []
        key = str(cell_id)
        cell = session.cells.get(key)
        if cell is None or not cell.announced:
            # Never announced (its execute was cancelled): the client does not know it.
            if cell is not None:
                for message in cell.early:
                    self._release(message.id)
                del session.cells[key]
            return self._maybe_session_closed(session_id, session)
        sends = [
            revoked
            for delegate_id in list(cell.callbacks)
            for revoked in self.revoke_callback(delegate_id)
        ]
        cell.close_requested = True  # after the revocations, which must not close the cell
        return sends + self._maybe_cell_closed(session_id, session, key, cell)

    def _maybe_cell_closed(
        self, session_id: str, session: _Session, key: str, cell: _Cell
    ) -> list[Send]:
        if not cell.close_requested or cell.open_answers > 0 or cell.callbacks:
            return []
        del session.cells[key]
        self._active_cells -= 1
        sends = [Send(CellClosed(session_id, key))]
        return sends + self._maybe_session_closed(session_id, session)

    def _maybe_session_closed(self, session_id: str, session: _Session) -> list[Send]:
        if not session.shut_down or session.cells:
            return []
        request_id = session.shutdown_request
        del self._sessions[session_id]
        if request_id is None or self._finish(request_id) is None:
            return []
        return [self._answer(request_id, SessionClosed(session_id))]

    def start_callback(
        self, session_id: str, cell_id: CellId, request: DelegateRequest
    ) -> tuple[int | None, list[Send]]:
        """Issue a callback to the client; ``None`` when 1,024 are already unresolved."""
        session = self._sessions.get(session_id)
        if len(self._callbacks) >= MAX_PENDING_DELEGATE_CALLS - self._reserved_for_others(
            session_id
        ):
            return None, []
        delegate_id = self._next_delegate_id
        self._next_delegate_id += 1
        key = str(cell_id)
        self._callbacks[delegate_id] = (session_id, key)
        if session is not None:
            session.pending += 1
        message = DelegateRequestMessage(delegate_id, session_id, request)
        cell = None if session is None else session.cells.setdefault(key, _Cell())
        if cell is None:
            return delegate_id, [Send(message)]
        cell.callbacks.add(delegate_id)
        if not cell.announced:
            cell.early.append(message)  # execution/started goes first (§8.2)
            return delegate_id, []
        return delegate_id, [Send(message)]

    def _reserved_for_others(self, session_id: str) -> int:
        """Slots kept free for the other sessions of this connection.

        Sessions sharing a connection share its 1,024-callback budget (§8.6); so that one session's
        cell cannot use it all up and starve the others' tool calls, every other open session keeps
        up to ``SESSION_CALLBACK_RESERVE`` slots it is not using. Only near the limit is it summed.
        """
        if len(self._callbacks) < MAX_PENDING_DELEGATE_CALLS - SESSION_CALLBACK_RESERVE * len(
            self._sessions
        ):
            return 0
        return sum(
            max(0, SESSION_CALLBACK_RESERVE - other.pending)
            for other_id, other in self._sessions.items()
            if other_id != session_id and not other.shut_down
        )

    def _release(self, delegate_id: int) -> tuple[str, str] | None:
        owner = self._callbacks.pop(delegate_id, None)
        if owner is not None and (session := self._sessions.get(owner[0])) is not None:
            session.pending -= 1
        return owner

    def revoke_callback(self, delegate_id: int) -> list[Send]:
        """The host no longer wants callback ``delegate_id``: ``delegate/cancel`` (if it was sent)."""
        owner = self._release(delegate_id)
        if owner is None:
            return []
        self._revoked.add(delegate_id)
        cell = self._forget_callback(delegate_id, owner)
        if cell is not None and not cell.announced:
            cell.early = [m for m in cell.early if m.id != delegate_id]
            return []
        sends = [Send(DelegateCancel(delegate_id))]
        if cell is not None:
            session = self._sessions[owner[0]]
            sends += self._maybe_cell_closed(owner[0], session, owner[1], cell)
        return sends

    def callback_unsent(self, delegate_id: int) -> list[Send]:
        """A callback could not be sent (too large for a frame): release its slot quietly."""
        owner = self._release(delegate_id)
        if owner is None:
            return []
        self._revoked.add(delegate_id)
        cell = self._forget_callback(delegate_id, owner)
        if cell is None:
            return []
        return self._maybe_cell_closed(owner[0], self._sessions[owner[0]], owner[1], cell)

    def _forget_callback(self, delegate_id: int, owner: tuple[str, str]) -> _Cell | None:
        session = self._sessions.get(owner[0])
        cell = None if session is None else session.cells.get(owner[1])
        if cell is not None:
            cell.callbacks.discard(delegate_id)
        return cell

    @property
    def pending_callbacks(self) -> int:
        """Callbacks sent (or queued) and neither answered nor revoked."""
        return len(self._callbacks)

    @property
    def active_cells(self) -> int:
        """Admitted cells whose ``cell/closed`` has not been sent."""
        return self._active_cells

    # -- the end -----------------------------------------------------------------------------------

    def connection_lost(self) -> tuple[list[int], list[int]]:
        """The connection ended: nothing more is sent. Returns the in-flight request ids and the
        unresolved callback ids, for the glue to cancel and fail."""
        self._closing = True
        requests = list(self._requests)
        callbacks = list(self._callbacks)
        self._requests.clear()
        self._callbacks.clear()
        return requests, callbacks
