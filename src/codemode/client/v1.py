"""Remote sessions over Protocol V1 (``protocol-v1.md`` §9): the asyncio glue.

:class:`V1ClientConnection` drives one :class:`~codemode.protocol.v1.client_state.ClientConnection`
over any :class:`~codemode.transports.FrameTransport`: it performs the handshake, runs the one
reader task, writes what the state machine asks for, runs delegate callbacks as tasks and turns the
machine's events into results for :class:`RemoteSession` callers. Carriers (a child process's
pipes, a WebSocket, the in-memory test pair) only move frames; :func:`connect_v1` is their entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any, Final, TypeVar

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    FrameError,
    ProtocolError,
)
from codemode.protocol.constants import HANDSHAKE_TIMEOUT
from codemode.protocol.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    NoopCodeModeSessionDelegate,
    StartedCell,
)
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)
from codemode.protocol.v1.client_state import (
    CALLBACK_TASK_CANCELLED,
    CONNECTION_CLOSED,
    CallbackCancelled,
    CallbackFailed,
    CallbackRequested,
    CallbackResult,
    CellClosedEvent,
    ClientConnection,
    ConnectionFailed,
    Event,
    ExecutionStartedEvent,
    InitialResponse,
    NotificationAccepted,
    NotificationCallback,
    OperationFailed,
    Send,
    SessionForgotten,
    SessionOpened,
    SessionShutDown,
    ToolReturned,
    WaitAnswered,
    delegate_failed,
    message_type,
    read_failed,
    write_failed,
    wrong_lane,
)
from codemode.protocol.v1.codec import MessageDecoder, encode_frame
from codemode.protocol.v1.handshake import Negotiated, check_handshake_reply, client_hello
from codemode.protocol.v1.lanes import Lane, allows_lane
from codemode.protocol.v1.messages import HostToClient
from codemode.protocol.v1.revision import WireRevision
from codemode.transports.base import FrameTransport, TransportError

__all__ = [
    "BULK_UNAVAILABLE",
    "HANDSHAKE_EXITED",
    "HANDSHAKE_TIMED_OUT",
    "RemoteSession",
    "V1ClientConnection",
    "connect_v1",
]

logger = logging.getLogger("codemode.client")

#: C2
HANDSHAKE_TIMED_OUT: Final = "timed out negotiating with the code-mode host"
#: C3
HANDSHAKE_EXITED: Final = "code-mode host exited during handshake"
#: C5 prefix
_INVALID_HANDSHAKE: Final = "code-mode host returned an invalid handshake response: "
#: C6 prefix
BULK_UNAVAILABLE: Final = "code-mode host bulk connection is unavailable: "

_DECODERS: Final[dict[WireRevision, MessageDecoder[HostToClient]]] = {
    revision: MessageDecoder(HostToClient, revision) for revision in WireRevision
}
_NOOP_DELEGATE: Final = NoopCodeModeSessionDelegate()

T = TypeVar("T")

#: Opens the bulk socket of a dual connection, given the ``bulkConnectionToken``.
OpenBulk = Callable[[str], Awaitable[None]]
#: Returns the failure reason to record when the host's stream ends cleanly (K1 by default).
EofReason = Callable[[], Awaitable[str]]


async def _connection_closed() -> str:
    return CONNECTION_CLOSED


def _detail(error: BaseException) -> str:
    return str(error) or type(error).__name__


class V1ClientConnection:
    """One V1 connection to a host, shared by every :class:`RemoteSession` opened on it.

    Create it with :func:`connect_v1` (or construct, then :meth:`handshake` and :meth:`start`).
    ``eof_reason`` decides the failure reason of a clean end of stream (a process-owned host
    reports its exit status, K2). ``wire_revision`` is the shape runtime responses must have
    (``pinned``: V1 as pinned; ``latest``: upstream 0.164+ with timing fields; decision 0007).
    Once the connection fails it stays dead: :meth:`is_alive` is
    false and every later operation raises :class:`~codemode.errors.ConnectionClosed` with the
    first recorded reason.
    """

    def __init__(
        self,
        transport: FrameTransport,
        *,
        dual: bool = False,
        eof_reason: EofReason | None = None,
        wire_revision: WireRevision | str = WireRevision.PINNED,
    ) -> None:
        self.wire_revision = WireRevision(wire_revision)
        self._decoder = _DECODERS[self.wire_revision]
        self._transport = transport
        self._dual_hello = dual
        self._eof_reason = eof_reason or _connection_closed
        self._loop = asyncio.get_running_loop()
        self._state: ClientConnection | None = None
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._delegates: dict[str, CodeModeSessionDelegate] = {}
        self._sessions: dict[str, RemoteSession] = {}
        self._tokens: dict[int, CancellationToken] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._dead = asyncio.Event()
        self._death_callbacks: list[Callable[[str], object]] = []

    # -- lifecycle -------------------------------------------------------------------------------

    async def handshake(
        self, *, timeout: float = HANDSHAKE_TIMEOUT, open_bulk: OpenBulk | None = None
    ) -> Negotiated:
        """Send the hello and check the reply (§3.4); raise :class:`CodeModeError` C2-C6.

        On failure the transport is closed and the connection is dead with that message.
        """
        if self._state is not None:
            raise RuntimeError("the handshake already happened")
        try:
            negotiated = await self._negotiate(timeout, open_bulk)
        except CodeModeError as error:
            self._state = ClientConnection()
            self._fail(error.message)
            await self._await_closer()
            raise
        self._state = ClientConnection(negotiated)
        return negotiated

    async def _negotiate(self, timeout: float, open_bulk: OpenBulk | None) -> Negotiated:
        transport = self._transport
        hello = client_hello(dual_websocket=self._dual_hello)
        try:
            transport.send(encode_frame(hello), Lane.CONTROL)
            await transport.drain()
        except (TransportError, OSError):
            # The host is gone before it could answer (a dead child's stdin is a broken pipe).
            raise CodeModeError(HANDSHAKE_EXITED) from None
        try:
            async with asyncio.timeout(timeout):
                item = await transport.receive()
        except TimeoutError:
            raise CodeModeError(HANDSHAKE_TIMED_OUT) from None
        except FrameError as error:
            raise CodeModeError(_INVALID_HANDSHAKE + error.message) from None
        except (CodeModeError, OSError):
            raise CodeModeError(HANDSHAKE_EXITED) from None
        if item is None:
            raise CodeModeError(HANDSHAKE_EXITED)
        payload, lane = item
        try:
            reply = self._decoder.decode(payload)
        except FrameError as error:
            raise CodeModeError(_INVALID_HANDSHAKE + error.message) from None
        if transport.dual and lane is not Lane.CONTROL:
            raise CodeModeError(_INVALID_HANDSHAKE + wrong_lane(message_type(reply), lane))
        negotiated = check_handshake_reply(hello, reply)
        token = negotiated.bulk_connection_token
        if negotiated.dual_websocket:
            if open_bulk is None or token is None:
                raise CodeModeError(BULK_UNAVAILABLE + "this carrier has no bulk socket")
            try:
                await open_bulk(token)
            except Exception as error:
                raise CodeModeError(BULK_UNAVAILABLE + _detail(error)) from None
        return negotiated

    def start(self) -> None:
        """Start the reader task (after a successful :meth:`handshake`)."""
        if self._state is None:
            raise RuntimeError("handshake first")
        if self._reader is None and self._state.is_alive():
            self._reader = asyncio.create_task(self._read_loop(), name="codemode-v1-reader")

    def add_death_callback(self, callback: Callable[[str], object]) -> None:
        """Call ``callback(reason)`` once when the connection fails (at once if it already has)."""
        if self._state is not None and self._state.failure is not None:
            callback(self._state.failure)
        else:
            self._death_callbacks.append(callback)

    def is_alive(self) -> bool:
        """False once the connection failed; it never comes back (§9.8)."""
        return self._state is not None and self._state.is_alive()

    @property
    def failure(self) -> str | None:
        """The first recorded failure reason, or ``None`` while alive."""
        return None if self._state is None else self._state.failure

    @property
    def negotiated(self) -> Negotiated:
        """What the handshake granted."""
        return self._machine.negotiated

    async def wait_closed(self) -> None:
        """Return once the connection is dead and its transport closed."""
        await self._dead.wait()
        await self._await_closer()

    async def aclose(self) -> None:
        """Close the connection (pending calls fail with K1) and wait for the reader to stop."""
        if self._state is None:
            self._state = ClientConnection()
        self._fail(CONNECTION_CLOSED)
        await self.wait_closed()
        reader = self._reader
        if reader is not None and not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def __aenter__(self) -> V1ClientConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- sessions --------------------------------------------------------------------------------

    async def open_session(
        self,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits | None = None,
    ) -> RemoteSession:
        """Open a session (``session/open``) served by ``delegate``; returns after
        ``session/ready``. Non-default ``limits`` need the negotiated capability (C7)."""
        machine = self._machine
        self._check_alive()
        try:
            request_id, session_id, sends = machine.open_session(limits)
        except ProtocolError as error:
            raise self._fatal(error) from None
        # Registered before anything is sent: callbacks for the session can only follow its ready.
        self._delegates[session_id] = delegate
        future = self._register(request_id, sends)
        try:
            await self._drain()
            await future
        except asyncio.CancelledError:
            self._cancel(request_id)
            raise
        session = RemoteSession(self, session_id)
        self._sessions[session_id] = session
        return session

    async def _execute(self, session: RemoteSession, request: ExecuteRequest) -> StartedCell:
        session_id = session.session_id
        request_id, future = self._begin(lambda m: m.execute(session_id, request))
        try:
            await self._drain()
            cell_id, initial = await future
        except asyncio.CancelledError:
            # Also covers a cancellation racing a just-arrived execution/started: the machine
            # then cancels on the wire and terminates the admitted cell (§9.3).
            self._cancel(request_id)
            raise

        def abandon() -> None:
            self._schedule(self._abandon, session_id, cell_id, request_id)

        return StartedCell.from_awaitable(cell_id, initial, abandon)

    async def _wait(self, session: RemoteSession, request: WaitRequest) -> WaitOutcome:
        session_id = session.session_id
        request_id, future = self._begin(lambda m: m.wait(session_id, request))
        try:
            await self._drain()
            outcome: WaitOutcome = await future
        except asyncio.CancelledError:
            self._cancel(request_id)
            raise
        return outcome

    async def _terminate(self, session: RemoteSession, cell_id: CellId) -> WaitOutcome:
        session_id = session.session_id
        request_id, future = self._begin(lambda m: m.terminate(session_id, cell_id))
        try:
            await self._drain()
            outcome: WaitOutcome = await future
        except asyncio.CancelledError:
            self._cancel(request_id)  # the terminate goes on; its answer is discarded
            raise
        return outcome

    def _start_shutdown(self, session: RemoteSession) -> asyncio.Future[None]:
        session_id = session.session_id
        _, future = self._begin(lambda m: m.shutdown(session_id))
        return future

    async def _drained(self, session: RemoteSession) -> None:
        """Wait until every cell of ``session`` has had its ``cell_closed``."""
        while self._machine.open_cells(session.session_id):
            session._cells_changed.clear()
            await session._cells_changed.wait()

    # -- plumbing --------------------------------------------------------------------------------

    @property
    def _machine(self) -> ClientConnection:
        if self._state is None:
            raise RuntimeError("the connection has not completed its handshake")
        return self._state

    def _check_alive(self) -> None:
        failure = self._machine.failure
        if failure is not None:
            raise ConnectionClosed(failure)

    def _begin(
        self, start: Callable[[ClientConnection], tuple[int, Sequence[Event]]]
    ) -> tuple[int, asyncio.Future[Any]]:
        try:
            request_id, events = start(self._machine)
        except ProtocolError as error:
            raise self._fatal(error) from None
        return request_id, self._register(request_id, events)

    def _register(self, request_id: int, events: Sequence[Event]) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        self._futures[request_id] = future
        self._handle(events)
        return future

    async def _drain(self) -> None:
        """Back-pressure for callers: wait until the carrier took what was queued."""
        if not self.is_alive():
            return
        try:
            await self._transport.drain()
        except (TransportError, OSError) as error:
            self._fail(write_failed(_detail(error)))

    def _fatal(self, error: ProtocolError) -> ConnectionClosed:
        """A local call hit a connection error (request id exhaustion): the connection dies."""
        self._fail(error.message)
        return ConnectionClosed(self._machine.failure or error.message)

    def _cancel(self, request_id: int) -> None:
        # After an execution/started that raced the cancellation this is the initial-response
        # future, orphaned now: the machine discards that answer.
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._call(lambda m: m.cancel(request_id))

    def _abandon(self, session_id: str, cell_id: CellId, request_id: int) -> None:
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._call(lambda m: m.abandon_cell(session_id, cell_id, request_id))

    def _call(self, step: Callable[[ClientConnection], Sequence[Event]]) -> None:
        """Run a machine step whose only failure is a connection error, and act on its events."""
        try:
            events = step(self._machine)
        except ProtocolError as error:
            self._fail(error.message)
            return
        self._handle(events)

    def _schedule(self, function: Callable[..., None], *args: Any) -> None:
        # Abandonment may run from a finalizer (any time, even inside the machine): defer it.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(function, *args)

    def _fail(self, reason: str) -> None:
        self._handle(self._machine.fail(reason))

    def _handle(self, events: Sequence[Event]) -> None:
        write_failure: str | None = None
        for event in events:
            if isinstance(event, Send):
                if write_failure is None:
                    write_failure = self._write(event)
            else:
                self._apply(event)
        if write_failure is not None:
            self._fail(write_failed(write_failure))

    def _write(self, send: Send) -> str | None:
        if not self.is_alive():
            return None
        lane = send.lane if self._transport.dual else Lane.CONTROL
        try:
            self._transport.send(send.frame, lane)
        except (TransportError, OSError) as error:
            return _detail(error)
        return None

    def _apply(self, event: Event) -> None:
        futures = self._futures
        if isinstance(event, CallbackRequested):
            self._run_callback(event)
        elif isinstance(event, CallbackCancelled):
            token = self._tokens.get(event.delegate_id)
            if token is not None:
                token.cancel()
        elif isinstance(event, CellClosedEvent):
            self._cell_closed(event.session_id, event.cell_id)
        elif isinstance(event, ExecutionStartedEvent):
            future = futures.pop(event.request_id, None)
            initial: asyncio.Future[RuntimeResponse] = self._loop.create_future()
            futures[event.request_id] = initial
            _resolve(future, (event.cell_id, initial))
        elif isinstance(event, InitialResponse):
            _resolve(futures.pop(event.request_id, None), event.response)
        elif isinstance(event, WaitAnswered):
            _resolve(futures.pop(event.request_id, None), event.outcome)
        elif isinstance(event, SessionOpened | SessionShutDown):
            _resolve(futures.pop(event.request_id, None), None)
        elif isinstance(event, OperationFailed):
            future = futures.pop(event.request_id, None)
            error_type = ConnectionClosed if event.connection_lost else CodeModeError
            if future is not None and not future.done():
                future.set_exception(error_type(event.message))
                future.exception()  # a caller that went away must not trigger "never retrieved"
        elif isinstance(event, SessionForgotten):
            self._delegates.pop(event.session_id, None)
            self._sessions.pop(event.session_id, None)
        elif isinstance(event, ConnectionFailed):
            self._connection_failed(event.reason)

    def _connection_failed(self, reason: str) -> None:
        self._dead.set()
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        self._closer = asyncio.ensure_future(self._close_transport())
        for session in self._sessions.values():
            session._cells_changed.set()
        callbacks, self._death_callbacks = self._death_callbacks, []
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                logger.exception("connection death callback failed")

    async def _close_transport(self) -> None:
        try:
            await self._transport.close()
        except Exception as error:
            logger.debug("closing the transport failed: %s", error)

    async def _await_closer(self) -> None:
        closer = self._closer
        if closer is not None:
            await asyncio.shield(closer)

    # -- the reader ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        transport = self._transport
        dual = transport.dual
        reason: str | None = None
        try:
            while reason is None and self.is_alive():
                try:
                    item = await transport.receive()
                except (ProtocolError, ConnectionClosed) as error:
                    reason = error.message  # a carrier's exact reason (e.g. K7)
                    break
                except (CodeModeError, OSError) as error:
                    reason = read_failed(_detail(error))
                    break
                if item is None:
                    reason = await self._eof_reason() if self.is_alive() else None
                    break
                payload, lane = item
                try:
                    message = self._decoder.decode(payload)
                except FrameError as error:
                    reason = read_failed(error.message)
                    break
                if dual and not allows_lane(message, lane):
                    reason = wrong_lane(message_type(message), lane)
                    break
                try:
                    events = self._machine.receive(message)
                except ProtocolError as error:
                    reason = error.message
                    break
                self._handle(events)
        except asyncio.CancelledError:
            if self.is_alive():
                reason = CONNECTION_CLOSED
            raise
        except Exception as error:  # a bug here must not leave callers hanging
            logger.exception("the V1 client reader failed")
            reason = read_failed(_detail(error))
        finally:
            if reason is not None:
                self._fail(reason)

    # -- callbacks -------------------------------------------------------------------------------

    def _run_callback(self, event: CallbackRequested) -> None:
        delegate = self._delegates.get(event.session_id, _NOOP_DELEGATE)
        token = CancellationToken()
        self._tokens[event.delegate_id] = token
        callback = event.callback
        coroutine: Awaitable[Any]
        if isinstance(callback, NotificationCallback):
            coroutine = delegate.notify(callback.call_id, callback.cell_id, callback.text, token)
        else:
            coroutine = delegate.invoke_tool(callback.invocation, token)
        is_notification = isinstance(callback, NotificationCallback)
        delegate_id = event.delegate_id
        if isinstance(coroutine, Coroutine):
            # Run the first step now: a delegate that answers without suspending is settled in
            # this loop iteration (no Task, no wake-up, no done-callback hop).
            context = contextvars.copy_context()
            try:
                yielded = context.run(coroutine.send, None)
            except StopIteration as stop:
                self._tokens.pop(delegate_id, None)
                self._settle(delegate_id, _ok(stop.value, is_notification))
                return
            except BaseException as error:
                self._tokens.pop(delegate_id, None)
                self._settle(delegate_id, _failed(error))
                if not isinstance(error, Exception):
                    raise
                return
            coroutine = _resume(coroutine, yielded)
            task = self._loop.create_task(
                self._serve(delegate_id, coroutine, is_notification), context=context
            )
        else:
            task = asyncio.ensure_future(self._serve(delegate_id, coroutine, is_notification))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, delegate_id: int, awaitable: Awaitable[Any], is_notification: bool
    ) -> None:
        # Settles from inside the task: no done-callback hop through the loop.
        try:
            value = await awaitable
        except asyncio.CancelledError:
            self._tokens.pop(delegate_id, None)
            self._settle(delegate_id, CallbackFailed(CALLBACK_TASK_CANCELLED))
            raise
        except BaseException as error:
            self._tokens.pop(delegate_id, None)
            self._settle(delegate_id, _failed(error))
            if not isinstance(error, Exception):
                raise
            return
        self._tokens.pop(delegate_id, None)
        self._settle(delegate_id, _ok(value, is_notification))

    def _settle(self, delegate_id: int, result: CallbackResult) -> None:
        self._call(lambda m: m.finish_callback(delegate_id, result))

    def _callback_done(
        self, delegate_id: int, task: asyncio.Future[Any], is_notification: bool
    ) -> None:
        self._tasks.discard(task)
        self._tokens.pop(delegate_id, None)
        result: CallbackResult
        if task.cancelled():
            result = CallbackFailed(CALLBACK_TASK_CANCELLED)
        elif (error := task.exception()) is not None:
            if isinstance(error, CodeModeError):
                result = CallbackFailed(error.message)
            else:
                result = CallbackFailed(delegate_failed(_detail(error)))
        elif is_notification:
            result = NotificationAccepted()
        else:
            result = ToolReturned(task.result())
        self._call(lambda m: m.finish_callback(delegate_id, result))

    def _cell_closed(self, session_id: str, cell_id: CellId) -> None:
        delegate = self._delegates.get(session_id)
        if delegate is not None:
            try:
                delegate.cell_closed(cell_id)
            except Exception:
                logger.exception("cell_closed(%s) failed", cell_id)
        session = self._sessions.get(session_id)
        if session is not None:
            session._cells_changed.set()


async def _guard(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _ok(value: Any, is_notification: bool) -> CallbackResult:
    return NotificationAccepted() if is_notification else ToolReturned(value)


def _failed(error: BaseException) -> CallbackResult:
    if isinstance(error, CodeModeError):
        return CallbackFailed(error.message)
    return CallbackFailed(delegate_failed(_detail(error)))


@types.coroutine
def _resume(coroutine: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """``yield from coroutine`` for a coroutine whose first step already yielded ``yielded``."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coroutine.close()
            raise
        except BaseException as error:
            try:
                yielded = coroutine.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coroutine.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


def _resolve(future: asyncio.Future[Any] | None, value: object) -> None:
    if future is not None and not future.done():
        future.set_result(value)


class RemoteSession(CodeModeSession):
    """A :class:`~codemode.protocol.session.CodeModeSession` served by a V1 host.

    It behaves like the embedded session for its caller (§1.5): ``execute`` returns at admission,
    abandoning a :class:`StartedCell` terminates the cell, cancelling ``wait`` only retires the
    observation, cancelled ``terminate``/``shutdown`` complete in the background. Once the
    connection fails, :meth:`is_alive` is false and every call raises the recorded reason;
    :meth:`shutdown` then succeeds after the remaining cells' ``cell_closed``.
    """

    def __init__(self, connection: V1ClientConnection, session_id: str) -> None:
        self._connection = connection
        self.session_id = session_id
        self._shutdown: asyncio.Future[None] | None = None
        self._cells_changed = asyncio.Event()

    @property
    def connection(self) -> V1ClientConnection:
        """The connection this session is bound to (never replaced, §9.8)."""
        return self._connection

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        """Admit a cell on the host; its first outcome is ``initial_response()``."""
        return await self._connection._execute(self, request)

    async def wait(self, request: WaitRequest) -> WaitOutcome:
        """Observe a cell for up to ``request.yield_time_ms``."""
        return await self._connection._wait(self, request)

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        """Stop a cell and return its final outcome."""
        return await self._connection._terminate(self, cell_id)

    async def shutdown(self) -> None:
        """Close the session on the host (idempotent, shared by concurrent callers)."""
        connection = self._connection
        if not connection.is_alive():
            # A dead session's shutdown succeeds once its cells were released (§9.5); one that
            # was pending when the connection died failed with the reason (§9.8).
            await connection._drained(self)
            return
        if self._shutdown is None:
            self._shutdown = connection._start_shutdown(self)
        await asyncio.shield(self._shutdown)

    def is_alive(self) -> bool:
        """False once the connection failed."""
        return self._connection.is_alive()

    def __repr__(self) -> str:
        return f"RemoteSession({self.session_id!r})"


async def connect_v1(
    transport: FrameTransport,
    *,
    dual: bool = False,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    open_bulk: OpenBulk | None = None,
    eof_reason: EofReason | None = None,
    wire_revision: WireRevision | str = WireRevision.PINNED,
) -> V1ClientConnection:
    """Handshake over ``transport`` and start the reader; the entry point for every carrier.

    ``dual`` lists ``dual-websocket-v1`` in the hello; when the host grants it, ``open_bulk(token)``
    must open the bulk socket (C6 otherwise). ``wire_revision`` (``pinned`` or ``latest``) is the
    shape of runtime responses accepted from the host; the handshake is the same in both.
    """
    connection = V1ClientConnection(
        transport, dual=dual, eof_reason=eof_reason, wire_revision=wire_revision
    )
    await connection.handshake(timeout=handshake_timeout, open_bulk=open_bulk)
    connection.start()
    return connection
