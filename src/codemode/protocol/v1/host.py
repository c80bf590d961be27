"""The host end of a V1 connection as a sans-I/O machine (``protocol-v1.md`` §3.3, §8).

:class:`HostProtocol` answers the hello, checks every client message (duplicate ids, admission
limits, cancellation, lanes, the callback cap) and tells its glue which operations to run on the
sessions (:class:`~codemode.protocol.v1.events.StartExecute`, …). The glue reports each
operation's result back (``session_opened``, ``execution_started``, …) and issues the runtime's
callbacks (``start_tool_call``, ``start_notification``); the answers, ``cell/closed`` and
``session/closed`` come out of ``data_to_send()`` in the order §8 requires. Answers too large
for a frame are rewritten here (H8, J5); a client that breaks the protocol ends the connection
with the exact L text. Operation problems are error answers, never connection errors.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Final

from codemode.errors import (
    FrameError,
    FrameErrorKind,
    RemoteProtocolError,
    WireConversionError,
)
from codemode.protocol.constants import (
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    MAX_PENDING_DELEGATE_CALLS,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    NotificationAccepted,
    ToolReturned,
)
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    RuntimeResponse,
    WaitOutcome,
)
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1 import messages as wire
from codemode.protocol.v1 import texts
from codemode.protocol.v1.codec import (
    LARGE_FRAME_BYTES,
    UPSTREAM_MAX_NESTING,
    LargePayload,
    MessageDecoder,
)
from codemode.protocol.v1.conversions import (
    execute_request_to_domain,
    limits_to_domain,
    nested_tool_call_to_wire,
    runtime_response_to_wire,
    wait_outcome_to_wire,
    wait_request_to_domain,
)
from codemode.protocol.v1.endpoint import Endpoint
from codemode.protocol.v1.handshake import Negotiated, negotiate
from codemode.protocol.v1.lanes import Lane
from codemode.protocol.v1.recent import RecentIds
from codemode.protocol.v1.revision import AUTO_REVISION, WireRevision, revision_for_hello

__all__ = ["SESSION_CALLBACK_RESERVE", "HostProtocol"]

#: A frame nested deeper than upstream's reader takes is a decode error (docs/interop.md).
_DECODER: Final = MessageDecoder[wire.ClientToHost](
    wire.ClientToHost, max_depth=UPSTREAM_MAX_NESTING
)
#: The same, handing frames of LARGE_FRAME_BYTES or more on undecoded (``large_frames_apart``).
_APART_DECODER: Final = MessageDecoder[wire.ClientToHost](
    wire.ClientToHost, max_depth=UPSTREAM_MAX_NESTING, apart_from=LARGE_FRAME_BYTES
)

#: Unresolved-callback slots each session keeps for itself on a shared connection (a decision of
#: ours within §8.6's per-connection limit; docs/security.md). With more than 8 open sessions
#: each keeps less, so that the reserves together never hold more than half of the limit.
SESSION_CALLBACK_RESERVE: Final = 64


#: Refusals held for arrival order at most (ordered_refusals); beyond, a refusal leaves at once.
_MAX_HELD_REFUSALS: Final = 64


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
    arrived_ns: int
    cell_id: str | None = None  # the cell its answer names (wait, terminate, started execute)
    admitted: bool = False  # execute: execution/started was sent
    cancelled: bool = False


@dataclass(slots=True)
class _Cell:
    announced: bool = False
    open_answers: int = 0  # in-flight answers that name this cell
    close_requested: bool = False
    early: list[tuple[int, tuple[bytes | bytearray, Lane]]] = field(default_factory=list)
    callbacks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Session:
    cells: dict[str, _Cell] = field(default_factory=dict)
    pending: int = 0  # this session's share of the connection's unresolved callbacks
    admitting: int = 0  # executes not yet admitted or refused: session/closed waits for them
    closed_cells: RecentIds[str] = field(default_factory=RecentIds)
    shutdown_request: int | None = None
    shut_down: bool = False


@dataclass(frozen=True, slots=True)
class _Callback:
    session_id: str
    cell_id: str
    notification: bool


class HostProtocol(Endpoint[wire.ClientToHost, wire.HostToClient, ev.HostEvent]):
    """The host side of one V1 connection (§3.3, §8), sans-I/O.

    With ``wire_revision=latest`` runtime responses carry ``code_mode_host_duration_ns``,
    measured with ``clock`` from a request's arrival to its answer; with ``"auto"`` the client's
    hello chooses (:func:`~codemode.protocol.v1.revision.revision_for_hello`).

    With ``large_frames_apart``, a frame of ``LARGE_FRAME_BYTES`` or more is not decoded here: it
    comes out as :class:`~codemode.protocol.v1.events.LargeFrame`, for the glue to decode off
    its event loop and report with :meth:`receive_decoded`.
    """

    def __init__(
        self,
        *,
        capabilities: Iterable[str] = (SESSION_RESOURCE_LIMITS_CAPABILITY,),
        max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS,
        max_active_cells: int = DEFAULT_MAX_ACTIVE_CELLS,
        wire_revision: WireRevision | str = WireRevision.PINNED,
        new_token: Callable[[], str] = lambda: secrets.token_urlsafe(24),
        clock: Callable[[], int] = time.monotonic_ns,
        ordered_refusals: bool = False,
        large_frames_apart: bool = False,
    ) -> None:
        super().__init__(_APART_DECODER if large_frames_apart else _DECODER)
        self._capabilities = frozenset(capabilities)
        # "auto": the hello decides (revision_for_hello); until then, pinned.
        self._auto = wire_revision == AUTO_REVISION
        #: The shape runtime responses are written in (``latest`` adds the timing fields).
        self.wire_revision = WireRevision.PINNED if self._auto else WireRevision(wire_revision)
        self._timed = self.wire_revision is WireRevision.LATEST
        self._max_in_flight = max_in_flight_requests
        self._max_active_cells = max_active_cells
        self._new_token = new_token
        self._clock = clock
        self._greeted = False
        self._stopped = False
        self.negotiated: Negotiated | None = None
        self._requests: dict[int, _Request] = {}
        self._finished: RecentIds[int] = RecentIds()
        self._sessions: dict[str, _Session] = {}  # open, plus shutting down until closed
        self._opened: RecentIds[str] = RecentIds()
        self._admitting = 0
        self._active_cells = 0
        self._next_delegate_id = 1
        self._callbacks: dict[int, _Callback] = {}
        self._revoked: RecentIds[int] = RecentIds()
        self._in_grace: set[int] = set()  # revoked, and their end not yet reported
        # ordered_refusals: a refusal waits behind the requests handed to the glue before it since
        # the glue's last release_refusals() that have no answer yet, so that answers leave in
        # arrival order. Those requests by place (request id -> place; answered or not, by place;
        # every place below _batch_low answered); held refusals with the count of places before.
        self._ordered = ordered_refusals
        self._batch_places: dict[int, int] = {}
        self._batch_answered: list[bool] = []
        self._batch_low = 0
        self._held: deque[tuple[int, tuple[bytes | bytearray, Lane]]] = deque()
        self.failure: str | None = None

    # -- inspection ------------------------------------------------------------------------------

    def in_flight(self, request_id: int) -> bool:
        """True while ``request_id`` has not received its last answer."""
        return request_id in self._requests

    def cancelled(self, request_id: int) -> bool:
        """True when the client cancelled ``request_id`` (and it may not be admitted any more)."""
        request = self._requests.get(request_id)
        return request is not None and request.cancelled

    def session_idle(self, session_id: str) -> bool:
        """True when ``session_id`` is open with no cell the client knows of (none announced
        and not yet closed) and no execute being admitted: its shutdown has nothing to wait for."""
        session = self._sessions.get(session_id)
        return session is not None and not session.admitting and not session.cells

    @property
    def pending_callbacks(self) -> int:
        """Callbacks sent (or queued) and neither answered nor revoked."""
        return len(self._callbacks)

    @property
    def active_cells(self) -> int:
        """Admitted cells whose ``cell/closed`` has not been sent."""
        return self._active_cells

    # -- client messages ------------------------------------------------------------------------

    def _message(self, message: wire.ClientToHost) -> None:
        if not self._greeted:
            self._hello(message)
        elif isinstance(message, wire.OperationRequest):
            self._request(message)
        elif isinstance(message, wire.OperationCancel):
            self._cancel(message.id)
        elif isinstance(message, wire.DelegateResponseMessage):
            self._delegate_response(message)
        else:
            raise RemoteProtocolError(texts.SECOND_HELLO)

    def _hello(self, first: wire.ClientToHost) -> None:
        self._greeted = True
        reply, granted = negotiate(first, self._capabilities, new_token=self._new_token)
        self._queue(reply)
        if granted is None:
            self._end(None)  # rejected: the reply is the last frame
            return
        self.negotiated = granted
        self._dual = granted.dual_websocket
        if self._auto and isinstance(first, wire.ConnectionHello):
            self.wire_revision = revision_for_hello(first)
            self._timed = self.wire_revision is WireRevision.LATEST
        self._emit(ev.HandshakeComplete(granted))

    def _request(self, message: wire.OperationRequest) -> None:
        request_id, request = message.id, message.request
        if request_id in self._requests or request_id in self._finished:
            raise RemoteProtocolError(texts.duplicate_request_id(request_id))
        if len(self._requests) >= self._max_in_flight:
            # Not held for order: a client over the limit gets its answer at once.
            self._finished.add(request_id)
            self._queue(wire.OperationResponse(request_id, wire.WireError(texts.TOO_MANY_REQUESTS)))
            return
        if self._stopped:
            self._refuse(request_id, texts.HOST_SHUTTING_DOWN)
            return
        arrived = self._clock() if self._timed else 0
        session_id = request.session_id
        if isinstance(request, wire.SessionOpen):
            self._open(request_id, request, arrived)
            return
        if isinstance(request, wire.SessionExecute):  # conversion comes before the session (§8.2)
            try:
                domain = execute_request_to_domain(request.request)
            except WireConversionError as error:
                self._refuse(request_id, texts.invalid_execute_request(error))
                return
        session = self._sessions.get(session_id)
        if session is None or session.shutdown_request is not None:
            self._refuse(request_id, texts.unknown_session(session_id))
            return
        if isinstance(request, wire.SessionExecute):
            if self._active_cells + self._admitting >= self._max_active_cells:
                self._refuse(request_id, texts.TOO_MANY_CELLS)
                return
            self._admitting += 1
            session.admitting += 1
            self._requests[request_id] = _Request(_Kind.EXECUTE, session_id, arrived)
            self._arrived(request_id)
            self._emit(ev.StartExecute(request_id, session_id, domain))
        elif isinstance(request, wire.SessionWait):
            cell_id = request.request.cell_id
            self._track_answer(
                request_id, _Kind.WAIT, session, session_id, cell_id, arrived=arrived
            )
            self._emit(
                ev.StartWait(request_id, session_id, wait_request_to_domain(request.request))
            )
        elif isinstance(request, wire.SessionTerminate):
            cell_id = request.cell_id
            self._track_answer(
                request_id, _Kind.TERMINATE, session, session_id, cell_id, arrived=arrived
            )
            self._emit(ev.StartTerminate(request_id, session_id, CellId(cell_id)))
        else:
            session.shutdown_request = request_id
            self._requests[request_id] = _Request(_Kind.SHUTDOWN, session_id, arrived)
            self._arrived(request_id)
            self._emit(ev.StartShutdown(request_id, session_id))

    def _open(self, request_id: int, request: wire.SessionOpen, arrived: int) -> None:
        session_id = request.session_id
        wire_limits = request.cell_execution_limits
        if wire_limits is not wire.UNSET and (
            self.negotiated is None or not self.negotiated.resource_limits
        ):
            self._refuse(request_id, texts.LIMITS_NOT_NEGOTIATED)
            return
        existing = self._sessions.get(session_id)
        if existing is not None and existing.shutdown_request is None:
            self._refuse(request_id, texts.session_already_open(session_id))
            return
        if existing is not None or session_id in self._opened:
            self._refuse(request_id, texts.session_id_reused(session_id))
            return
        self._opened.add(session_id)
        self._sessions[session_id] = _Session()
        limits = (
            CodeModeSessionCellExecutionLimits()
            if wire_limits is wire.UNSET
            else limits_to_domain(wire_limits)
        )
        self._requests[request_id] = _Request(_Kind.OPEN, session_id, arrived)
        self._arrived(request_id)
        self._emit(ev.OpenSession(request_id, session_id, limits))

    def _track_answer(
        self,
        request_id: int,
        kind: _Kind,
        session: _Session,
        session_id: str,
        cell_id: str,
        *,
        arrived: int,
    ) -> None:
        cell = session.cells.get(cell_id)
        if cell is not None:
            cell.open_answers += 1
        # Only an answer counted on a known cell holds (and later releases) its cell/closed.
        known = None if cell is None else cell_id
        self._requests[request_id] = _Request(kind, session_id, arrived, known)
        self._arrived(request_id)

    def _refuse(self, request_id: int, message: str) -> None:
        self._finished.add(request_id)
        response = wire.OperationResponse(request_id, wire.WireError(message))
        places = len(self._batch_answered)
        if self._batch_low < places and len(self._held) < _MAX_HELD_REFUSALS:
            self._held.append((places, self._encode(response)))
        else:
            self._queue(response)

    def _arrived(self, request_id: int) -> None:
        """``request_id`` was handed to the glue: refusals after it wait for its first answer."""
        if self._ordered:
            self._batch_places[request_id] = len(self._batch_answered)
            self._batch_answered.append(False)

    def _first_answer(self, request_id: int) -> None:
        """``request_id`` was answered (its first answer was queued): the refusals behind it go."""
        place = self._batch_places.pop(request_id, None)
        if place is None:
            return
        self._batch_answered[place] = True
        self._advance()

    def _advance(self) -> None:
        answered = self._batch_answered
        low = self._batch_low
        while low < len(answered) and answered[low]:
            low += 1
        self._batch_low = low
        held = self._held
        while held and held[0][0] <= low:
            self._write(held.popleft()[1])
        if low == len(answered) and not held:  # nothing waits: a new batch
            self._batch_places.clear()
            self._batch_answered = []
            self._batch_low = 0

    def release_refusals(self) -> None:
        """Write the held refusals (``ordered_refusals``): the glue calls this once the
        operations that arrived with them had their first chance to answer. Those that did not
        may take long (a wait's outcome): refusals stop waiting for them, except for an execute
        not yet admitted — its session's engine is starting, and its ``execution/started`` comes
        soon, before the refusals that arrived after it (as the upstream host, which admits at
        once, answers them)."""
        answered = self._batch_answered
        for request_id, place in list(self._batch_places.items()):
            request = self._requests.get(request_id)
            if request is None or request.kind is not _Kind.EXECUTE or request.admitted:
                del self._batch_places[request_id]
                answered[place] = True
        self._advance()

    @property
    def holds_refusals(self) -> bool:
        """True while a batch of requests is kept in arrival order (see ``release_refusals``)."""
        return bool(self._batch_answered)

    def _cancel(self, request_id: int) -> None:
        request = self._requests.get(request_id)
        if request is None or request.cancelled:
            return
        if request.kind is _Kind.WAIT or (request.kind is _Kind.EXECUTE and not request.admitted):
            request.cancelled = True
            self._emit(ev.CancelOperation(request_id))
        # open, terminate, shutdown and admitted executes are not cancellable

    def _delegate_response(self, message: wire.DelegateResponseMessage) -> None:
        delegate_id = message.id
        callback = self._release(delegate_id)
        if callback is None:
            if delegate_id in self._revoked:
                return  # the client answered a callback we had already revoked
            raise RemoteProtocolError(texts.unknown_callback_answered(delegate_id))
        cell = self._forget_callback(delegate_id, callback)
        self._emit(ev.CallbackResolved(delegate_id, _callback_result(callback, message.result)))
        if cell is not None:
            session = self._sessions[callback.session_id]
            self._maybe_cell_closed(callback.session_id, session, callback.cell_id, cell)

    # -- results of the glue's operations ---------------------------------------------------------

    def session_opened(self, request_id: int) -> None:
        """``session/open`` succeeded."""
        request = self._finish(request_id)
        if request is not None:
            self._answer(request_id, wire.SessionReady(request.session_id))

    def operation_failed(self, request_id: int, message: str) -> None:
        """Answer ``request_id`` with an error (a failed open forgets the session again)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.kind is _Kind.EXECUTE and request.admitted:
            self._initial(request_id, wire.WireError(message))
            return
        self._finish(request_id)
        self._queue(wire.OperationResponse(request_id, wire.WireError(message)))
        self._first_answer(request_id)
        if request.kind in (_Kind.OPEN, _Kind.SHUTDOWN):
            # A failed open never made the session; a failed shutdown leaves it unusable.
            self._sessions.pop(request.session_id, None)
        elif request.kind is _Kind.EXECUTE:
            self._admitting -= 1
            session = self._sessions.get(request.session_id)
            if session is not None:
                session.admitting -= 1
                self._maybe_session_closed(request.session_id, session)
        self._answered_cell(request)

    def operation_cancelled(self, request_id: int) -> None:
        """A cancelled operation stopped (H1)."""
        self.operation_failed(request_id, texts.REQUEST_CANCELLED)

    def session_unavailable(self, request_id: int) -> None:
        """The session ``request_id`` was for never opened (its open failed): H5."""
        request = self._requests.get(request_id)
        if request is not None:
            self.operation_failed(request_id, texts.unknown_session(request.session_id))

    def operation_crashed(self, request_id: int, error: BaseException) -> None:
        """The glue's own operation failed unexpectedly: answer rather than leave the client
        waiting."""
        self.operation_failed(request_id, texts.host_internal_error(error))

    def execution_started(self, request_id: int, cell_id: CellId) -> bool:
        """The execute was admitted as ``cell_id``. False means the client cancelled it first:
        it was answered H1, and the glue must abandon the cell."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.cancelled:
            self.operation_cancelled(request_id)
            return False
        session = self._sessions.get(request.session_id)
        if session is None or session.shut_down:  # its shutdown came first: the cell is gone
            self.session_unavailable(request_id)
            return False
        session.admitting -= 1
        request.admitted = True
        request.cell_id = str(cell_id)
        self._admitting -= 1
        self._active_cells += 1
        cell = session.cells.setdefault(str(cell_id), _Cell())
        cell.announced = True
        cell.open_answers += 1  # the initial response names it
        self._answer(request_id, wire.ExecutionStarted(str(cell_id)))
        for _, frame in cell.early:
            self._write(frame)
        cell.early.clear()
        return True

    def initial_response(self, request_id: int, response: RuntimeResponse, excess: int = 0) -> None:
        """The admitted cell's first outcome. Its texts may be encoded already, or measured
        (``excess``), as a tool call's input (:meth:`start_tool_call`)."""
        request = self._requests.get(request_id)
        if request is not None:
            response = self._timed_response(response, request)
            body = runtime_response_to_wire(response, self.wire_revision)
            self._initial(request_id, wire.WireOk(body), excess)

    def _initial(
        self, request_id: int, result: wire.WireOk[Any] | wire.WireError, excess: int = 0
    ) -> None:
        request = self._finish(request_id)
        if request is None:
            return
        try:
            self._queue(wire.ExecuteInitialResponse(request_id, result), excess)
        except FrameError as error:
            detail = wire.WireError(texts.response_too_large(_oversize(error)))
            self._queue(wire.ExecuteInitialResponse(request_id, detail))
        self._first_answer(request_id)
        self._answered_cell(request)

    def wait_completed(self, request_id: int, outcome: WaitOutcome, excess: int = 0) -> None:
        """A wait or terminate finished with ``outcome`` (its texts as in
        :meth:`initial_response`)."""
        request = self._finish(request_id)
        if request is None:
            return
        outcome = type(outcome)(self._timed_response(outcome.response, request))
        self._answer(
            request_id,
            wire.WaitCompleted(wait_outcome_to_wire(outcome, self.wire_revision)),
            excess,
        )
        self._answered_cell(request)

    def session_shut_down(self, request_id: int) -> None:
        """The runtime finished shutting the session down; ``session/closed`` follows the last
        ``cell/closed`` of the session."""
        request = self._requests.get(request_id)
        if request is None:
            return
        session = self._sessions.get(request.session_id)
        if session is None:  # its open failed after the shutdown was accepted
            self.session_unavailable(request_id)
            return
        session.shut_down = True
        self._maybe_session_closed(request.session_id, session)

    def _timed_response(self, response: RuntimeResponse, request: _Request) -> RuntimeResponse:
        if not self._timed:
            return response
        return replace(response, host_duration_ns=self._clock() - request.arrived_ns)

    def _answer(self, request_id: int, value: wire.HostResponse, excess: int = 0) -> None:
        try:
            self._queue(wire.OperationResponse(request_id, wire.WireOk(value)), excess)
        except FrameError as error:
            detail = wire.WireError(texts.response_too_large(_oversize(error)))
            self._queue(wire.OperationResponse(request_id, detail))
        self._first_answer(request_id)

    def _finish(self, request_id: int) -> _Request | None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._finished.add(request_id)
        return request

    def _answered_cell(self, request: _Request) -> None:
        session = self._sessions.get(request.session_id)
        if session is None or request.cell_id is None:
            return
        cell = session.cells.get(request.cell_id)
        if cell is not None:
            cell.open_answers -= 1
            self._maybe_cell_closed(request.session_id, session, request.cell_id, cell)

    # -- cells and callbacks -------------------------------------------------------------------------

    def cell_closed(self, session_id: str, cell_id: CellId) -> None:
        """The runtime retired a cell; ``cell/closed`` goes out once every answer naming the
        cell was sent and its callbacks are resolved or revoked."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        key = str(cell_id)
        cell = session.cells.get(key)
        if cell is None or not cell.announced:
            # Never announced (its execute was cancelled): the client does not know it.
            if cell is not None:
                for delegate_id, _ in cell.early:
                    self._release(delegate_id)
                del session.cells[key]
            session.closed_cells.add(key)
            self._maybe_session_closed(session_id, session)
            return
        for delegate_id in reversed(list(cell.callbacks)):  # newest first, as upstream
            self.revoke_callback(delegate_id)
        cell.close_requested = True  # after the revocations, which must not close the cell
        self._maybe_cell_closed(session_id, session, key, cell)

    def _maybe_cell_closed(self, session_id: str, session: _Session, key: str, cell: _Cell) -> None:
        if not cell.close_requested or cell.open_answers > 0 or cell.callbacks:
            return
        del session.cells[key]
        session.closed_cells.add(key)
        self._active_cells -= 1
        self._queue(wire.CellClosed(session_id, key))
        self._maybe_session_closed(session_id, session)

    def _maybe_session_closed(self, session_id: str, session: _Session) -> None:
        if not session.shut_down or session.cells or session.admitting:
            return
        request_id = session.shutdown_request
        del self._sessions[session_id]
        if request_id is not None and self._finish(request_id) is not None:
            self._answer(request_id, wire.SessionClosed(session_id))

    def start_tool_call(
        self, session_id: str, invocation: CodeModeNestedToolCall, *, excess: int = 0
    ) -> int:
        """Send a nested tool call to the client; its end arrives as ``CallbackResolved``.

        The input may be encoded already (a ``msgspec.Raw``); ``excess``: the bytes it lacks,
        measured elsewhere (see :meth:`Endpoint._encode`)."""
        request = wire.ToolInvoke(nested_tool_call_to_wire(invocation))
        return self._start_callback(session_id, str(invocation.cell_id), request, False, excess)

    def start_notification(
        self, session_id: str, call_id: str, cell_id: CellId, text: str, *, excess: int = 0
    ) -> int:
        """Send a ``notify(...)`` text to the client; its end arrives as ``CallbackResolved``.
        The text may be encoded already, or measured (``excess``), as a tool call's input."""
        request = wire.NotificationSend(call_id, str(cell_id), text)
        return self._start_callback(session_id, str(cell_id), request, True, excess)

    def _start_callback(
        self,
        session_id: str,
        cell_id: str,
        request: wire.DelegateRequest,
        notification: bool,
        excess: int,
    ) -> int:
        delegate_id = self._next_delegate_id
        self._next_delegate_id += 1
        if self._ended:
            self._resolve(delegate_id, texts.CLIENT_CONNECTION_CLOSED)
            return delegate_id
        session = self._sessions.get(session_id)
        if session is not None and cell_id in session.closed_cells:
            # A call from a cell that is already closed: the client would refuse it anyway.
            self._resolve(delegate_id, texts.callback_for_unknown_cell(cell_id, session_id))
            return delegate_id
        limit = MAX_PENDING_DELEGATE_CALLS - self._reserved_for_others(session_id)
        if len(self._callbacks) >= limit:
            self._resolve(delegate_id, texts.TOO_MANY_CALLBACKS)
            return delegate_id
        try:
            message = wire.DelegateRequestMessage(delegate_id, session_id, request)
            frame = self._encode(message, excess)
        except FrameError as error:
            self._resolve(delegate_id, texts.callback_too_large(_oversize(error)))
            return delegate_id
        self._callbacks[delegate_id] = _Callback(session_id, cell_id, notification)
        if session is None:
            self._write(frame)
            return delegate_id
        session.pending += 1
        cell = session.cells.setdefault(cell_id, _Cell())
        cell.callbacks.add(delegate_id)
        if cell.announced:
            self._write(frame)
        else:
            cell.early.append((delegate_id, frame))  # execution/started goes first (§8.2)
        return delegate_id

    def _resolve(self, delegate_id: int, message: str) -> None:
        self._emit(ev.CallbackResolved(delegate_id, CallbackFailed(message)))

    def _reserved_for_others(self, session_id: str) -> int:
        """Slots kept free for the other sessions of this connection.

        Sessions sharing a connection share its 1,024-callback budget (§8.6); so that one session's
        cell cannot use it all up and starve the others' tool calls, every other open session keeps
        up to ``SESSION_CALLBACK_RESERVE`` slots it is not using (fewer beyond 8 sessions: half of
        the limit at most in all, or a connection with 17 sessions could make no call at all). Only
        near the limit is it summed.
        """
        sessions = len(self._sessions)
        reserve = min(
            SESSION_CALLBACK_RESERVE, MAX_PENDING_DELEGATE_CALLS // (2 * max(1, sessions))
        )
        if len(self._callbacks) < MAX_PENDING_DELEGATE_CALLS - reserve * sessions:
            return 0
        return sum(
            max(0, reserve - other.pending)
            for other_id, other in self._sessions.items()
            if other_id != session_id and not other.shut_down
        )

    def _release(self, delegate_id: int) -> _Callback | None:
        callback = self._callbacks.pop(delegate_id, None)
        if callback is not None and (session := self._sessions.get(callback.session_id)):
            session.pending -= 1
        return callback

    def revoke_callback(self, delegate_id: int) -> None:
        """The host no longer wants callback ``delegate_id``: ``delegate/cancel`` (if it was
        sent). The client's answer no longer counts; the callback ends when the glue reports
        :meth:`revocation_expired` (after the runtime's grace, as a local delegate would)."""
        callback = self._release(delegate_id)
        if callback is None:
            return
        self._revoked.add(delegate_id)
        self._in_grace.add(delegate_id)
        cell = self._forget_callback(delegate_id, callback)
        if cell is not None and not cell.announced:
            cell.early = [item for item in cell.early if item[0] != delegate_id]
            return
        self._queue(wire.DelegateCancel(delegate_id))
        if cell is not None:
            session = self._sessions[callback.session_id]
            self._maybe_cell_closed(callback.session_id, session, callback.cell_id, cell)

    def revocation_expired(self, delegate_id: int) -> None:
        """The grace of a revoked callback ran out: it ends as revoked."""
        if delegate_id in self._in_grace:
            self._in_grace.discard(delegate_id)
            self._resolve(delegate_id, texts.CALLBACK_REVOKED)

    def _forget_callback(self, delegate_id: int, callback: _Callback) -> _Cell | None:
        session = self._sessions.get(callback.session_id)
        cell = None if session is None else session.cells.get(callback.cell_id)
        if cell is not None:
            cell.callbacks.discard(delegate_id)
        return cell

    # -- what the glue reports, and the end --------------------------------------------------------

    def stop_admitting(self) -> None:
        """The host is shutting down: every later request is answered H4; running work goes on."""
        self._stopped = True

    def read_failed(self, detail: str) -> None:
        """Reading from the client failed (L1 before the hello, else L2); after the frames read
        before (one being decoded apart)."""
        if not self._hold(self.read_failed, detail):
            self._end(self._read_error(detail))

    def write_failed(self, detail: str) -> None:
        """Writing to the client failed."""
        self._end(texts.client_write_failed(detail))

    def text_received(self) -> None:
        """The client sent a text WebSocket message (L8), after the frames read before."""
        if not self._hold(self.text_received):
            self._end(texts.CLIENT_SENT_TEXT)

    def bulk_not_established(self) -> None:
        """The bulk socket of a dual connection did not connect in time (L9)."""
        self._end(texts.BULK_NOT_ESTABLISHED)

    def close(self) -> None:
        """This side ends the connection (nothing more is sent)."""
        self._end(None)

    def _end(self, reason: str | None) -> None:
        if self._ended:
            return
        self.release_refusals()  # what was answered goes out before the end
        self._ended = True
        self.failure = reason
        requests = tuple(self._requests)
        self._requests.clear()
        for delegate_id in [*self._callbacks, *self._in_grace]:
            self._resolve(delegate_id, texts.CLIENT_CONNECTION_CLOSED)
        self._callbacks.clear()
        self._in_grace.clear()
        self._emit(ev.ConnectionEnded(reason, requests))

    def _large_frame(self, payload: LargePayload[Any]) -> None:
        self._emit(ev.LargeFrame(payload))

    def _read_error(self, detail: str) -> str:
        if not self._greeted:
            return texts.hello_read_failed(detail)
        return texts.client_read_failed(detail)

    def _wrong_lane(self, message_type: str, lane: str) -> str:
        return texts.client_wrong_lane(message_type, lane)

    def _end_of_stream(self) -> None:
        return None


def _oversize(error: FrameError) -> str:
    """The detail of a frame that is too large; any other encoding failure is a bug here."""
    if error.kind is not FrameErrorKind.OVERSIZE:
        raise error
    return error.message


def _callback_result(
    callback: _Callback, result: wire.WireOk[wire.DelegateResponse] | wire.WireError
) -> CallbackResult:
    """What the client's answer means for the callback it answers (J2, J3 when it does not fit)."""
    if isinstance(result, wire.WireError):
        return CallbackFailed(result.message)
    value = result.value
    if callback.notification:
        if isinstance(value, wire.NotificationDelivered):
            return NotificationAccepted()
        return CallbackFailed(texts.INVALID_NOTIFICATION_RESULT)
    if isinstance(value, wire.ToolResult):
        return ToolReturned(value.result)
    return CallbackFailed(texts.INVALID_TOOL_RESULT)
