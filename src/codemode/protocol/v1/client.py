"""The client end of a V1 connection as a sans-I/O machine (``protocol-v1.md`` §3.4, §9).

:class:`ClientProtocol` owns every client-side rule of one connection: the hello and the check of
the host's reply, request ids, sessions and their live cells, wait deferral, delegate callbacks
(parking, the 1,024 cap, revocation), lanes, and the first failure reason. Its glue feeds bytes
(:meth:`~ClientProtocol.receive_data`), starts operations (:meth:`~ClientProtocol.execute`, …),
reports callback ends (:meth:`~ClientProtocol.finish_callback`) and I/O failures
(:meth:`~ClientProtocol.read_failed`, …), then writes ``data_to_send()`` and acts on
``events_received()``.

A host that breaks the protocol ends the connection with the exact K text; a caller that misuses
the machine gets :class:`~codemode.errors.LocalProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Final

import msgspec

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    FrameError,
    LocalProtocolError,
    RemoteProtocolError,
)
from codemode.protocol.constants import I64_MAX, MAX_PENDING_DELEGATE_CALLS
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    NotificationAccepted,
    tool_result_json,
)
from codemode.protocol.texts import SESSION_SHUTTING_DOWN
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1 import messages as wire
from codemode.protocol.v1 import texts
from codemode.protocol.v1.codec import MessageDecoder
from codemode.protocol.v1.conversions import (
    execute_request_to_wire,
    limits_to_wire,
    nested_tool_call_to_domain,
    runtime_response_to_domain,
    wait_outcome_to_domain,
    wait_request_to_wire,
)
from codemode.protocol.v1.endpoint import Endpoint
from codemode.protocol.v1.handshake import Negotiated, check_handshake_reply, client_hello
from codemode.protocol.v1.lanes import Lane
from codemode.protocol.v1.recent import RecentIds
from codemode.protocol.v1.revision import WireRevision

__all__ = ["ClientProtocol"]

_DECODERS: Final[dict[WireRevision, MessageDecoder[wire.HostToClient]]] = {
    revision: MessageDecoder(wire.HostToClient, revision) for revision in WireRevision
}


class _Phase(Enum):
    HANDSHAKE = "handshake"  # hello sent, waiting for the reply
    PAIRING = "pairing"  # dual granted, waiting for the glue to open the bulk socket
    OPEN = "open"
    ENDED = "ended"


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
    queued: tuple[bytes | bytearray, Lane] | None = None  # a deferred wait's frame


@dataclass(eq=False, slots=True)
class _Callback:
    id: int
    session: _Session
    cell_id: str
    callback: ev.ToolCallback | ev.NotificationCallback
    state: _CallbackState
    cell: _Cell | None = None


class ClientProtocol(Endpoint[wire.HostToClient, wire.ClientToHost, ev.ClientEvent]):
    """The client side of one V1 connection (§3.4, §9), sans-I/O.

    The hello is queued at construction (``dual_websocket`` asks for a bulk socket).
    ``wire_revision`` is the shape runtime responses must have (``pinned`` or ``latest``).
    Operations may start after :class:`~codemode.protocol.v1.events.HandshakeComplete`.
    ``first_request_id`` exists for tests of id exhaustion.
    """

    def __init__(
        self,
        *,
        dual_websocket: bool = False,
        wire_revision: WireRevision | str = WireRevision.PINNED,
        first_request_id: int = 1,
    ) -> None:
        super().__init__(_DECODERS[WireRevision(wire_revision)])
        self._hello = client_hello(dual_websocket=dual_websocket)
        self._phase = _Phase.HANDSHAKE
        self._negotiated = Negotiated(frozenset(), None)
        self._next_request_id = first_request_id
        self._next_session = 1
        self._requests: dict[int, _Request] = {}
        self._sessions: dict[str, _Session] = {}
        self._callbacks: dict[int, _Callback] = {}
        self._finished_callbacks: RecentIds[int] = RecentIds()
        self._unresolved = 0  # parked + running callbacks (what the 1024 cap counts)
        self._failure: str | None = None
        self._queue(self._hello)

    # -- inspection ------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """The recorded connection failure reason, or ``None`` while alive."""
        return self._failure

    def is_alive(self) -> bool:
        """False once the connection ended."""
        return self._failure is None

    @property
    def negotiated(self) -> Negotiated:
        """What the handshake granted (nothing until it completed)."""
        return self._negotiated

    @property
    def handshaken(self) -> bool:
        """True once the host accepted the hello (a dual connection may still be pairing)."""
        return self._phase in (_Phase.PAIRING, _Phase.OPEN)

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

    # -- what the glue reports -----------------------------------------------------------------

    def bulk_opened(self) -> None:
        """The bulk socket of a dual connection is open: operations may start (§7.3)."""
        if self._phase is _Phase.PAIRING:
            self._phase = _Phase.OPEN

    def bulk_failed(self, detail: str) -> None:
        """The bulk socket could not be opened (C6)."""
        self._end(texts.bulk_unavailable(detail))

    def timed_out(self) -> None:
        """The handshake took too long (C2); no effect once it completed."""
        if self._phase is _Phase.HANDSHAKE:
            self._end(texts.HANDSHAKE_TIMED_OUT)

    def held_back(self, request_id: int) -> bool:
        """True while ``request_id`` is a wait not sent yet (§9.4): its deadline has not begun."""
        entry = self._requests.get(request_id)
        return entry is not None and entry.queued is not None

    def answer_overdue(self, request_id: int, operation: str) -> None:
        """The host has not answered ``request_id`` within the glue's deadline: the connection
        ends (``code-mode host timed out waiting for OPERATION response``). No effect once the
        answer came, or while the request is held back."""
        entry = self._requests.get(request_id)
        if entry is not None and entry.queued is None:
            self._end(texts.host_timed_out(operation))

    def read_failed(self, detail: str) -> None:
        """Reading from the host failed (K3; C3 during the handshake)."""
        self._end(self._during_handshake(texts.host_read_failed(detail)))

    def write_failed(self, detail: str) -> None:
        """Writing to the host failed (K4; C3 during the handshake)."""
        self._end(self._during_handshake(texts.host_write_failed(detail)))

    def text_received(self) -> None:
        """The host sent a text WebSocket message (K7)."""
        self._end(self._during_handshake(texts.HOST_SENT_TEXT))

    def host_exited(self, status: object) -> None:
        """A process-owned host exited with ``status`` (K2; C3 during the handshake)."""
        self._end(self._during_handshake(texts.host_exited(status)))

    def close(self) -> None:
        """This side closes the connection (K1 for everything still pending)."""
        self._end(self._during_handshake(texts.HOST_CONNECTION_CLOSED))

    def _during_handshake(self, reason: str) -> str:
        # Whatever ends a connection before the host answered, the caller learns only that.
        if self._phase is _Phase.HANDSHAKE:
            return texts.HOST_EXITED_DURING_HANDSHAKE
        return reason

    # -- operations (caller → host) --------------------------------------------------------------

    def open_session(self, limits: CodeModeSessionCellExecutionLimits | None = None) -> int:
        """Start ``session/open`` for a fresh session id; returns the request id (the id of the
        session is in :class:`~codemode.protocol.v1.events.SessionOpened`, and
        :meth:`session_of` knows it at once).

        Raises :class:`CodeModeError` C7 when non-default ``limits`` were not negotiated, and the
        conversion error (X1) when they do not fit the wire.
        """
        self._check_open()
        wire_limits: wire.WireSessionCellExecutionLimits | wire.UnsetType = wire.UNSET
        if limits is not None and not limits.is_default:
            if not self._negotiated.resource_limits:
                raise CodeModeError(texts.HOST_LACKS_LIMITS)
            wire_limits = limits_to_wire(limits)
        session_id = f"session-{self._next_session}"
        request_id, frame = self._request(wire.SessionOpen(session_id, wire_limits))
        self._next_session += 1
        session = _Session(session_id)
        self._sessions[session_id] = session
        self._requests[request_id] = _Request(request_id, _Kind.OPEN, session)
        self._write(frame)
        return request_id

    def session_of(self, request_id: int) -> str:
        """The session a pending request is for."""
        entry = self._requests.get(request_id)
        if entry is None:
            raise LocalProtocolError(f"request {request_id} is not pending")
        return entry.session.id

    def execute(self, session_id: str, request: ExecuteRequest) -> int:
        """Start ``session/execute``; the answers arrive as
        :class:`~codemode.protocol.v1.events.CellStarted` and
        :class:`~codemode.protocol.v1.events.InitialResponse` (or ``OperationFailed``)."""
        session = self._usable_session(session_id)
        request_id, frame = self._request(
            wire.SessionExecute(session_id, execute_request_to_wire(request))
        )
        session.admitting += 1
        self._requests[request_id] = _Request(request_id, _Kind.EXECUTE, session)
        self._write(frame)
        return request_id

    def wait(self, session_id: str, request: WaitRequest) -> int:
        """Start ``session/wait``. While a cancelled wait for the same cell is unanswered the
        request is held back and sent once that answer arrived (§9.4)."""
        session = self._usable_session(session_id)
        wire_request = wait_request_to_wire(request)
        request_id, frame = self._request(wire.SessionWait(session_id, wire_request))
        cell = wire_request.cell_id
        entry = _Request(request_id, _Kind.WAIT, session, cell)
        self._requests[request_id] = entry
        if session.cancelled_waits.get(cell):
            entry.queued = frame
            session.queued_waits.setdefault(cell, []).append(entry)
        else:
            self._write(frame)
        return request_id

    def terminate(self, session_id: str, cell_id: CellId) -> int:
        """Start ``session/terminate`` (never cancelled on the wire)."""
        session = self._usable_session(session_id)
        request_id, frame = self._request(wire.SessionTerminate(session_id, cell_id.value))
        self._requests[request_id] = _Request(request_id, _Kind.TERMINATE, session, cell_id.value)
        self._write(frame)
        return request_id

    def shutdown(self, session_id: str) -> int:
        """Start ``session/shutdown``. Executes of the session still awaiting admission fail at
        once with C10 (and are cancelled on the wire). ``SessionShutDown`` follows once
        ``session/closed`` arrived and every cell's ``cell_closed`` fired."""
        session = self._usable_session(session_id)
        request_id, frame = self._request(wire.SessionShutdown(session_id))
        session.state = _SessionState.SHUTTING_DOWN
        entry = _Request(request_id, _Kind.SHUTDOWN, session)
        session.shutdown = entry
        self._write(frame)
        for other in list(self._requests.values()):
            if other.session is session and other.kind is _Kind.EXECUTE and not other.started:
                if not other.cancelled:
                    self._emit(ev.OperationFailed(other.id, texts.SESSION_CLOSED_DURING_EXECUTE))
                other.cancelled = True
                self._cancel_on_wire(other)
        self._requests[request_id] = entry
        return request_id

    def cancel(self, request_id: int) -> None:
        """The caller of ``request_id`` went away (§1.5, §9.3-§9.5).

        open: the answer is discarded (a late ``session/ready`` is shut down at once); execute:
        ``operation/cancel`` once, and a ``session/terminate`` if the cell was admitted; wait:
        ``operation/cancel`` once, or a held-back wait is dropped unsent; terminate and
        shutdown: the answer is discarded. Unknown or finished ids are ignored.
        """
        entry = self._requests.get(request_id)
        if entry is None or entry.cancelled:
            return
        if entry.kind is _Kind.WAIT and entry.queued is not None:
            del self._requests[request_id]
            assert entry.cell is not None
            queue = entry.session.queued_waits[entry.cell]
            queue.remove(entry)
            if not queue:
                del entry.session.queued_waits[entry.cell]
            return
        entry.cancelled = True
        if entry.kind is _Kind.EXECUTE:
            self._cancel_on_wire(entry)
            if entry.started:
                cell = entry.session.cells.get(entry.cell or "")
                if cell is not None:
                    self._terminate_abandoned(cell)
        elif entry.kind is _Kind.WAIT:
            assert entry.cell is not None
            entry.session.cancelled_waits.setdefault(entry.cell, set()).add(request_id)
            self._cancel_on_wire(entry)

    def abandon_cell(self, session_id: str, cell_id: CellId, request_id: int) -> None:
        """A started cell was abandoned after admission (§9.3 step 4): cancel its execute if the
        initial response is still pending, and terminate the cell unless it is closed or its
        session is shutting down. Idempotent."""
        entry = self._requests.get(request_id)
        if (
            entry is not None
            and entry.kind is _Kind.EXECUTE
            and entry.started
            and entry.cell == cell_id.value
        ):
            entry.cancelled = True
            self._cancel_on_wire(entry)
        session = self._sessions.get(session_id)
        cell = None if session is None else session.cells.get(cell_id.value)
        if cell is not None:
            self._terminate_abandoned(cell)

    def finish_callback(self, delegate_id: int, result: CallbackResult) -> None:
        """Callback ``delegate_id``'s task ended with ``result``: its answer goes out (unless it
        was revoked), and ``cell_closed`` follows if this was the last task of a closed cell."""
        callback = self._callbacks.get(delegate_id)
        if callback is None or callback.state is _CallbackState.PARKED:
            raise LocalProtocolError(f"callback {delegate_id} is not running")
        del self._callbacks[delegate_id]
        self._finished_callbacks.add(delegate_id)
        if callback.state is _CallbackState.RUNNING:
            self._unresolved -= 1
            if self._failure is None:
                self._answer(delegate_id, callback.callback, result)
        cell = callback.cell
        assert cell is not None
        cell.callbacks.discard(delegate_id)
        if cell.closed and not cell.callbacks:
            self._report_closed(cell)

    # -- the end ---------------------------------------------------------------------------------

    def _end(self, reason: str | None) -> None:
        """Record the connection's death (§9.8); the first reason wins.

        Fails every pending call with ``reason``, revokes every running callback, drops parked
        ones, and closes every live cell (``cell_closed`` fires once its callbacks finished).
        """
        if self._failure is not None:
            return
        reason = reason or texts.HOST_CONNECTION_CLOSED
        self._failure = reason
        self._ended = True
        self._phase = _Phase.ENDED
        self._emit(ev.ConnectionEnded(reason))
        for entry in self._requests.values():
            if not entry.cancelled:
                self._emit(ev.OperationFailed(entry.id, reason, connection_lost=True))
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
                self._close_cell(cell)
        self._unresolved = 0

    def _read_error(self, detail: str) -> str:
        if self._phase is _Phase.HANDSHAKE:
            return texts.invalid_handshake_reply(detail)
        return texts.host_read_failed(detail)

    def _wrong_lane(self, message_type: str, lane: str) -> str:
        return texts.host_wrong_lane(message_type, lane)

    def _end_of_stream(self) -> str:
        return self._during_handshake(texts.HOST_CONNECTION_CLOSED)

    # -- host messages ---------------------------------------------------------------------------

    def _message(self, message: wire.HostToClient) -> None:
        # Validation happens before any state changes, so a violation leaves the bookkeeping
        # intact for _end().
        if self._phase is _Phase.HANDSHAKE:
            self._handshake_reply(message)
        elif isinstance(message, wire.OperationResponse):
            self._operation_response(message)
        elif isinstance(message, wire.ExecuteInitialResponse):
            self._initial_response(message)
        elif isinstance(message, wire.DelegateRequestMessage):
            self._delegate_request(message)
        elif isinstance(message, wire.DelegateCancel):
            self._delegate_cancel(message.id)
        elif isinstance(message, wire.CellClosed):
            self._cell_closed(message)
        else:
            raise RemoteProtocolError(texts.SECOND_HANDSHAKE_REPLY)

    def _handshake_reply(self, reply: wire.HostToClient) -> None:
        self._negotiated = check_handshake_reply(self._hello, reply)
        self._dual = self._negotiated.dual_websocket
        self._phase = _Phase.PAIRING if self._dual else _Phase.OPEN
        self._emit(ev.HandshakeComplete(self._negotiated))

    def _operation_response(self, message: wire.OperationResponse) -> None:
        entry = self._requests.get(message.id)
        if (
            entry is None
            or entry.queued is not None
            or (entry.kind is _Kind.EXECUTE and entry.started)
        ):
            raise RemoteProtocolError(texts.unknown_request_id(message.id))
        result = message.result
        if entry.kind is _Kind.OPEN:
            self._open_answered(entry, result)
        elif entry.kind is _Kind.EXECUTE:
            self._execute_answered(entry, result)
        elif entry.kind is _Kind.SHUTDOWN:
            self._shutdown_answered(entry, result)
        else:
            self._cell_answered(entry, result)

    def _open_answered(self, entry: _Request, result: object) -> None:
        session = entry.session
        if isinstance(result, wire.WireOk):
            value = result.value
            if not isinstance(value, wire.SessionReady) or value.session_id != session.id:
                raise RemoteProtocolError(texts.INVALID_OPEN_RESPONSE)
            del self._requests[entry.id]
            session.state = _SessionState.OPEN
            if entry.cancelled:
                # Nobody will ever use this session: close it on the host right away (§9.5).
                self._internal_shutdown(session)
            else:
                self._emit(ev.SessionOpened(entry.id, session.id))
            return
        assert isinstance(result, wire.WireError)
        del self._requests[entry.id]
        del self._sessions[session.id]
        if not entry.cancelled:
            self._emit(ev.OperationFailed(entry.id, result.message))
        self._emit(ev.SessionForgotten(session.id))

    def _execute_answered(self, entry: _Request, result: object) -> None:
        session = entry.session
        if isinstance(result, wire.WireOk):
            value = result.value
            if not isinstance(value, wire.ExecutionStarted):
                raise RemoteProtocolError(texts.INVALID_EXECUTE_RESPONSE)
            if value.cell_id in session.cells:
                raise RemoteProtocolError(texts.live_cell_reused(session.id))
            session.admitting -= 1
            cell = _Cell(session, value.cell_id)
            session.cells[cell.id] = cell
            session.unreported += 1
            entry.started = True
            entry.cell = cell.id
            if entry.cancelled:
                self._terminate_abandoned(cell)
            else:
                self._emit(ev.CellStarted(entry.id, session.id, CellId(cell.id)))
            for parked in list(session.parked.values()):
                if parked.cell_id == cell.id:
                    del session.parked[parked.id]
                    self._start_callback(parked, cell, counted=True)
        else:
            assert isinstance(result, wire.WireError)
            session.admitting -= 1
            del self._requests[entry.id]
            if not entry.cancelled:
                self._emit(ev.OperationFailed(entry.id, result.message))
        if session.admitting == 0:
            self._refuse_parked(session)

    def _cell_answered(self, entry: _Request, result: object) -> None:
        outcome: WaitOutcome | None = None
        if isinstance(result, wire.WireOk):
            value = result.value
            if not isinstance(value, wire.WaitCompleted):
                raise RemoteProtocolError(texts.INVALID_CELL_RESPONSE)
            got = value.outcome.response.body.cell_id
            if got != entry.cell:
                raise RemoteProtocolError(texts.wrong_cell_answered(got, entry.cell))
            outcome = wait_outcome_to_domain(value.outcome)
        del self._requests[entry.id]
        if not entry.cancelled:
            if outcome is not None:
                self._emit(ev.WaitAnswered(entry.id, outcome))
            else:
                assert isinstance(result, wire.WireError)
                self._emit(ev.OperationFailed(entry.id, result.message))
        if entry.kind is _Kind.WAIT and entry.cancelled:
            self._cancelled_wait_answered(entry)

    def _cancelled_wait_answered(self, entry: _Request) -> None:
        session, cell = entry.session, entry.cell
        assert cell is not None
        waiting = session.cancelled_waits.get(cell)
        if waiting is None:
            return
        waiting.discard(entry.id)
        if waiting:
            return
        del session.cancelled_waits[cell]
        # The last cancelled observation is gone: the held-back waits may go out now (§9.4).
        for queued in session.queued_waits.pop(cell, []):
            assert queued.queued is not None
            self._write(queued.queued)
            queued.queued = None

    def _shutdown_answered(self, entry: _Request, result: object) -> None:
        session = entry.session
        if isinstance(result, wire.WireError):
            raise RemoteProtocolError(texts.shutdown_failed(session.id, result.message))
        assert isinstance(result, wire.WireOk)
        value = result.value
        if not isinstance(value, wire.SessionClosed) or value.session_id != session.id:
            raise RemoteProtocolError(texts.INVALID_SHUTDOWN_RESPONSE)
        del self._requests[entry.id]
        session.closed = True
        for other in list(self._requests.values()):
            if other.session is not session or other.kind is not _Kind.EXECUTE:
                continue
            if not other.cancelled:
                other.cancelled = True
                self._emit(ev.OperationFailed(other.id, texts.SESSION_CLOSED_DURING_EXECUTE))
            if other.started:
                # The host sends every initial response before session/closed: a missing one
                # will never come, and a late one would be a protocol error (K8).
                del self._requests[other.id]
        # The host closes every cell before session/closed (§8.3). Should it not have, the cells
        # are gone anyway: release them so that cell_closed still fires exactly once.
        for cell in list(session.cells.values()):
            self._close_cell(cell)
        self._maybe_shut_down(session)

    def _initial_response(self, message: wire.ExecuteInitialResponse) -> None:
        entry = self._requests.get(message.id)
        if entry is None or entry.kind is not _Kind.EXECUTE or not entry.started:
            raise RemoteProtocolError(texts.unknown_request_id(message.id))
        result = message.result
        response: RuntimeResponse | None = None
        if isinstance(result, wire.WireOk):
            got = result.value.body.cell_id
            if got != entry.cell:
                raise RemoteProtocolError(texts.wrong_initial_response(got, entry.cell))
            response = runtime_response_to_domain(result.value)
        del self._requests[entry.id]
        if entry.cancelled:
            return
        if response is not None:
            self._emit(ev.InitialResponse(entry.id, response))
        else:
            assert isinstance(result, wire.WireError)
            self._emit(ev.OperationFailed(entry.id, result.message))

    # -- callbacks -------------------------------------------------------------------------------

    def _delegate_request(self, message: wire.DelegateRequestMessage) -> None:
        delegate_id = message.id
        if delegate_id in self._callbacks or delegate_id in self._finished_callbacks:
            raise RemoteProtocolError(texts.duplicate_callback_id(delegate_id))
        if self._unresolved >= MAX_PENDING_DELEGATE_CALLS:
            self._refuse(delegate_id, texts.TOO_MANY_CALLBACKS)
            return
        session = self._sessions.get(message.session_id)
        if session is None or session.state is _SessionState.OPENING or session.closed:
            self._refuse(delegate_id, texts.callback_for_unknown_session(message.session_id))
            return
        request = message.request
        callback: ev.ToolCallback | ev.NotificationCallback
        if isinstance(request, wire.ToolInvoke):
            callback = ev.ToolCallback(nested_tool_call_to_domain(request.invocation))
            cell_id = request.invocation.cell_id
        else:
            cell_id = request.cell_id
            callback = ev.NotificationCallback(request.call_id, CellId(cell_id), request.text)
        pending = _Callback(delegate_id, session, cell_id, callback, _CallbackState.PARKED)
        cell = session.cells.get(cell_id)
        if cell is not None:
            self._start_callback(pending, cell, counted=False)
        elif session.admitting > 0:
            # On a dual connection a tool/invoke (bulk) may overtake its execution/started
            # (control): hold it until the cell appears or no execute is left to admit it.
            session.parked[delegate_id] = pending
            self._callbacks[delegate_id] = pending
            self._unresolved += 1
        else:
            self._refuse(delegate_id, texts.callback_for_unknown_cell(cell_id, session.id))

    def _start_callback(self, callback: _Callback, cell: _Cell, *, counted: bool) -> None:
        if not counted:
            self._unresolved += 1
        callback.state = _CallbackState.RUNNING
        callback.cell = cell
        cell.callbacks.add(callback.id)
        self._callbacks[callback.id] = callback
        self._emit(ev.CallbackRequested(callback.id, callback.session.id, callback.callback))

    def _refuse_parked(self, session: _Session) -> None:
        for parked in list(session.parked.values()):
            del session.parked[parked.id]
            del self._callbacks[parked.id]
            self._unresolved -= 1
            self._refuse(parked.id, texts.callback_for_unknown_cell(parked.cell_id, session.id))

    def _refuse(self, delegate_id: int, message: str) -> None:
        self._finished_callbacks.add(delegate_id)
        self._queue(wire.DelegateResponseMessage(delegate_id, wire.WireError(message)))

    def _delegate_cancel(self, delegate_id: int) -> None:
        callback = self._callbacks.get(delegate_id)
        if callback is None or callback.state is _CallbackState.REVOKED:
            return  # unknown, finished or already revoked: nothing to do (§9.6, §7.3)
        self._unresolved -= 1
        if callback.state is _CallbackState.PARKED:
            del self._callbacks[delegate_id]
            del callback.session.parked[delegate_id]
            self._finished_callbacks.add(delegate_id)
            return
        callback.state = _CallbackState.REVOKED
        self._emit(ev.CallbackCancelled(delegate_id))

    def _answer(
        self,
        delegate_id: int,
        callback: ev.ToolCallback | ev.NotificationCallback,
        result: CallbackResult,
    ) -> None:
        """Queue the ``delegate/response`` for a finished callback (D5/D6 when it cannot be)."""
        answer: wire.WireOk[wire.DelegateResponse] | wire.WireError
        if isinstance(result, CallbackFailed):
            answer = wire.WireError(result.message)
        elif isinstance(callback, ev.NotificationCallback):
            answer = wire.WireOk(wire.NotificationDelivered())
        else:
            value = None if isinstance(result, NotificationAccepted) else result.value
            try:
                answer = wire.WireOk(wire.ToolResult(msgspec.Raw(tool_result_json(value))))
            except CodeModeError as error:
                answer = wire.WireError(error.message)
        try:
            self._queue(wire.DelegateResponseMessage(delegate_id, answer))
        except FrameError as error:
            # Only size can fail here: the value was already checked.
            text = texts.answer_too_large(error.message)
            self._queue(wire.DelegateResponseMessage(delegate_id, wire.WireError(text)))

    # -- cells and sessions ------------------------------------------------------------------------

    def _cell_closed(self, message: wire.CellClosed) -> None:
        session = self._sessions.get(message.session_id)
        cell = None if session is None else session.cells.get(message.cell_id)
        if cell is None:
            raise RemoteProtocolError(
                texts.unknown_cell_closed(message.cell_id, message.session_id)
            )
        self._close_cell(cell)

    def _close_cell(self, cell: _Cell) -> None:
        del cell.session.cells[cell.id]
        cell.closed = True
        for delegate_id in sorted(cell.callbacks):
            callback = self._callbacks[delegate_id]
            if callback.state is _CallbackState.RUNNING:
                callback.state = _CallbackState.REVOKED
                self._unresolved -= 1
                self._emit(ev.CallbackCancelled(delegate_id))
        if not cell.callbacks:
            self._report_closed(cell)

    def _report_closed(self, cell: _Cell) -> None:
        session = cell.session
        session.unreported -= 1
        self._emit(ev.CellClosed(session.id, CellId(cell.id)))
        self._maybe_shut_down(session)

    def _maybe_shut_down(self, session: _Session) -> None:
        if (
            not session.closed
            or session.unreported
            or self._sessions.get(session.id) is not session
        ):
            return
        del self._sessions[session.id]
        shutdown = session.shutdown
        if shutdown is not None and not shutdown.cancelled:
            self._emit(ev.SessionShutDown(shutdown.id, session.id))
        self._emit(ev.SessionForgotten(session.id))

    def _terminate_abandoned(self, cell: _Cell) -> None:
        session = cell.session
        if cell.abandoned or cell.closed or session.state is not _SessionState.OPEN:
            return
        cell.abandoned = True
        allocated = self._internal_request(wire.SessionTerminate(session.id, cell.id))
        if allocated is None:
            return
        request_id, frame = allocated
        self._requests[request_id] = _Request(
            request_id, _Kind.TERMINATE, session, cell.id, cancelled=True
        )
        self._write(frame)

    def _internal_shutdown(self, session: _Session) -> None:
        allocated = self._internal_request(wire.SessionShutdown(session.id))
        if allocated is None:
            return
        request_id, frame = allocated
        session.state = _SessionState.SHUTTING_DOWN
        entry = _Request(request_id, _Kind.SHUTDOWN, session, cancelled=True)
        session.shutdown = entry
        self._requests[request_id] = entry
        self._write(frame)

    # -- helpers ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._failure is not None:
            raise ConnectionClosed(self._failure)
        if self._phase is not _Phase.OPEN:
            raise LocalProtocolError(
                "the connection is not open yet: the handshake (and bulk pairing) must complete"
            )

    def _usable_session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None or session.state is _SessionState.SHUTTING_DOWN:
            raise CodeModeError(SESSION_SHUTTING_DOWN)
        self._check_open()
        if session.state is _SessionState.OPENING:
            raise LocalProtocolError(f"session {session_id} is not open yet")
        return session

    def _request(self, request: wire.HostRequest) -> tuple[int, tuple[bytes | bytearray, Lane]]:
        """Allocate the next request id and encode the request; nothing is committed on error.

        Running out of request ids ends the connection (K19) and raises
        :class:`LocalProtocolError`.
        """
        request_id = self._next_request_id
        if request_id > I64_MAX:
            self._end(texts.REQUEST_IDS_EXHAUSTED)
            raise LocalProtocolError(texts.REQUEST_IDS_EXHAUSTED)
        frame = self._encode(wire.OperationRequest(request_id, request))
        self._next_request_id = request_id + 1
        return request_id, frame

    def _internal_request(
        self, request: wire.HostRequest
    ) -> tuple[int, tuple[bytes | bytearray, Lane]] | None:
        """A request the machine sends on its own; ``None`` once the ids ran out (the connection
        has then ended with K19, which is no fault of whoever made the machine send it)."""
        try:
            return self._request(request)
        except LocalProtocolError:
            return None

    def _cancel_on_wire(self, entry: _Request) -> None:
        if entry.cancel_sent or self._failure is not None:
            return
        entry.cancel_sent = True
        self._queue(wire.OperationCancel(entry.id))
