"""Remote sessions over Protocol V1 (``protocol-v1.md`` §9): the asyncio glue.

:class:`V1ClientConnection` pumps bytes between a :class:`~codemode.transports.FrameTransport`
and a :class:`~codemode.protocol.v1.client.ClientProtocol`: it feeds what the transport reads,
writes what the machine queues, runs delegate callbacks as tasks and turns the machine's events
into results for :class:`RemoteSession` callers. Every protocol decision is the machine's.
:func:`connect_v1` is the entry point for every carrier.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

from codemode.errors import CodeModeError, ConnectionClosed
from codemode.protocol.arguments import (
    check_cell_id,
    check_execute_request,
    check_limits,
    check_wait_request,
)
from codemode.protocol.constants import (
    DEFAULT_EXEC_YIELD_TIME_MS,
    HANDSHAKE_TIMEOUT,
    SHUTDOWN_TIMEOUT,
)
from codemode.protocol.deadlines import DEFAULT_RESPONSE_TIMEOUT, observation_allowance
from codemode.protocol.delegation import CallbackResult
from codemode.protocol.options import checked_seconds
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1.client import ClientProtocol
from codemode.protocol.v1.handshake import Negotiated
from codemode.protocol.v1.revision import WireRevision
from codemode.session import (
    EARLY_YIELD_UNSUPPORTED,
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    NoopCodeModeSessionDelegate,
    StartedCell,
    cell_context,
    run_in,
    serve_callback,
)
from codemode.transports.base import FrameTransport, describe
from codemode.transports.pump import Pump

__all__ = ["RemoteSession", "V1ClientConnection", "connect_v1"]

logger = logging.getLogger("codemode.client")

_NOOP_DELEGATE: Final = NoopCodeModeSessionDelegate()

#: Opens the bulk socket of a dual connection, given the ``bulkConnectionToken``.
OpenBulk = Callable[[str], Awaitable[None]]
#: After the host's stream ended: its exit status if it is a process that exited, else ``None``.
ExitStatus = Callable[[], Awaitable[object | None]]


class V1ClientConnection:
    """One V1 connection to a host, shared by every :class:`RemoteSession` opened on it.

    Create it with :func:`connect_v1` (or construct, then :meth:`handshake` and :meth:`start`).
    ``exit_status`` tells a clean end of stream from an exited host process (K1 vs K2).
    ``wire_revision`` is the shape runtime responses must have (``pinned``: V1 as pinned;
    ``latest``: upstream 0.164+ with timing fields; decision 0007). Once the connection fails it
    stays dead: :meth:`is_alive` is false and every later operation raises
    :class:`~codemode.errors.ConnectionClosed` with the first recorded reason. A host that leaves
    a request unanswered for ``response_timeout`` seconds (default 60) past its runtime allowance
    (the yield time of an execute or a wait, plus 1 s) is given up as silent: the connection fails
    with ``code-mode host timed out waiting for OPERATION response`` (the rule of ``grpc.md``
    §13.3).
    """

    def __init__(
        self,
        transport: FrameTransport,
        *,
        dual: bool = False,
        exit_status: ExitStatus | None = None,
        wire_revision: WireRevision | str = WireRevision.PINNED,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
    ) -> None:
        self.wire_revision = WireRevision(wire_revision)
        self._response_timeout = checked_seconds("response_timeout", response_timeout)
        self._protocol = ClientProtocol(dual_websocket=dual, wire_revision=self.wire_revision)
        self._transport = transport
        self._dual = dual
        self._exit_status = exit_status
        self._loop = asyncio.get_running_loop()
        self._handshaken = False
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._delegates: dict[str, CodeModeSessionDelegate] = {}
        self._sessions: dict[str, RemoteSession] = {}
        self._tokens: dict[int, CancellationToken] = {}
        #: The context of each execute (by request id) until its cell is admitted, then of each
        #: cell until it closes: its callbacks run in it (``session.cell_context``).
        self._execute_contexts: dict[int, contextvars.Context] = {}
        self._cell_contexts: dict[tuple[str, CellId], contextvars.Context] = {}
        # Callback tasks by delegate id, held until they settle (the loop keeps weak references).
        self._callback_tasks: dict[int, asyncio.Future[Any]] = {}
        self._notifying: set[int] = set()  # those of them that deliver a notification
        # Each request's deadline: nothing else notices a host that stops answering over a pipe.
        self._deadlines: dict[int, asyncio.TimerHandle] = {}
        self._reader: asyncio.Task[None] | None = None
        self._handshake_replied: asyncio.Future[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._dead = asyncio.Event()
        self._death_callbacks: list[Callable[[str], object]] = []
        self._pump = Pump(transport, self._protocol, self._apply)
        self._flush = self._pump.flush

    # -- lifecycle -------------------------------------------------------------------------------

    async def handshake(
        self, *, timeout: float = HANDSHAKE_TIMEOUT, open_bulk: OpenBulk | None = None
    ) -> Negotiated:
        """Send the hello and check the reply (§3.4); raise :class:`CodeModeError` C2-C6.

        On failure the transport is closed and the connection is dead with that message.
        """
        protocol = self._protocol
        if self._handshaken:
            raise RuntimeError("the handshake already happened")
        if self._dual and open_bulk is None:
            raise ValueError("a dual connection needs open_bulk to open its bulk socket")
        self._handshaken = True
        self._flush()
        # The reader starts now: over a pushing transport the reply is dispatched as it arrives,
        # and the HandshakeComplete (or ConnectionEnded) event resolves this future.
        replied = self._handshake_replied = self._loop.create_future()
        self._start_reader()
        try:
            async with asyncio.timeout(timeout):
                if protocol.is_alive() and not protocol.handshaken:
                    await replied
        except TimeoutError:
            protocol.timed_out()
            self._flush()
        negotiated = protocol.negotiated
        if protocol.is_alive() and negotiated.dual_websocket:
            token = negotiated.bulk_connection_token
            assert token is not None
            assert open_bulk is not None
            try:
                await open_bulk(token)
            except Exception as error:
                protocol.bulk_failed(describe(error))
            else:
                protocol.bulk_opened()
            self._flush()
        failure = protocol.failure
        if failure is not None:
            await self._await_closer()
            raise CodeModeError(failure)
        return negotiated

    def start(self) -> None:
        """Start the reader task (after a successful :meth:`handshake`)."""
        if not self._handshaken:
            raise RuntimeError("handshake first")
        self._start_reader()

    def _start_reader(self) -> None:
        if self._reader is None and self._protocol.is_alive():
            self._reader = asyncio.create_task(self._read_loop(), name="codemode-v1-reader")

    def add_death_callback(self, callback: Callable[[str], object]) -> None:
        """Call ``callback(reason)`` once when the connection fails (at once if it already has)."""
        failure = self._protocol.failure
        if failure is not None:
            callback(failure)
        else:
            self._death_callbacks.append(callback)

    def is_alive(self) -> bool:
        """False once the connection failed; it never comes back (§9.8)."""
        return self._handshaken and self._protocol.is_alive()

    @property
    def failure(self) -> str | None:
        """The first recorded failure reason, or ``None`` while alive."""
        return self._protocol.failure

    @property
    def negotiated(self) -> Negotiated:
        """What the handshake granted."""
        return self._protocol.negotiated

    @property
    def protocol(self) -> ClientProtocol:
        """The state machine this connection drives (for inspection)."""
        return self._protocol

    async def wait_closed(self) -> None:
        """Return once the connection is dead and its transport closed."""
        await self._dead.wait()
        await self._await_closer()

    async def aclose(self) -> None:
        """Close the connection (pending calls fail with K1) and wait for the reader to stop."""
        self._protocol.close()
        self._flush()
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
        if limits is not None:
            check_limits(limits)
        request_id = self._start(lambda: self._protocol.open_session(limits))
        self._arm(request_id, "session opening", 0.0)
        session_id = self._protocol.session_of(request_id)
        # Registered before anything is sent: callbacks for the session can only follow its ready.
        self._delegates[session_id] = delegate
        await self._answer(request_id)
        session = RemoteSession(self, session_id)
        self._sessions[session_id] = session
        return session

    async def _execute(self, session: RemoteSession, request: ExecuteRequest) -> StartedCell:
        session_id = session.session_id
        request_id = self._start(lambda: self._protocol.execute(session_id, request))
        yield_ms = request.yield_time_ms
        yield_ms = DEFAULT_EXEC_YIELD_TIME_MS if yield_ms is None else yield_ms
        # Until the initial response.
        self._arm(request_id, "execution", observation_allowance(yield_ms))
        self._execute_contexts[request_id] = cell_context()
        # A cancellation racing a just-arrived execution/started makes the machine cancel on
        # the wire and terminate the admitted cell (§9.3).
        try:
            cell_id, initial = await self._answer(request_id)
        finally:
            self._execute_contexts.pop(request_id, None)

        def abandon() -> None:
            self._schedule(self._abandon, session_id, cell_id, request_id)

        return StartedCell.from_awaitable(cell_id, initial, abandon)

    async def _wait(self, session: RemoteSession, request: WaitRequest) -> WaitOutcome:
        session_id = session.session_id
        request_id = self._start(lambda: self._protocol.wait(session_id, request))
        self._arm(request_id, "wait", observation_allowance(request.yield_time_ms))
        outcome: WaitOutcome = await self._answer(request_id)
        return outcome

    async def _terminate(self, session: RemoteSession, cell_id: CellId) -> WaitOutcome:
        # Cancelled, the terminate goes on; its answer is discarded.
        request_id = self._start(lambda: self._protocol.terminate(session.session_id, cell_id))
        self._arm(request_id, "termination", 0.0)
        outcome: WaitOutcome = await self._answer(request_id)
        return outcome

    def _start_shutdown(self, session: RemoteSession) -> asyncio.Future[Any]:
        request_id = self._start(lambda: self._protocol.shutdown(session.session_id))
        self._arm(request_id, "session shutdown", SHUTDOWN_TIMEOUT)
        future = self._register(request_id)
        self._flush()
        return future

    async def _drained(self, session: RemoteSession) -> None:
        """Wait until every cell of ``session`` has had its ``cell_closed``."""
        while self._protocol.open_cells(session.session_id):
            session._cells_changed.clear()
            await session._cells_changed.wait()

    # -- plumbing --------------------------------------------------------------------------------

    def _start(self, operation: Callable[[], int]) -> int:
        """Start an operation on the machine; if it refuses, what it decided on the way (e.g.
        the end of the connection when request ids ran out) still goes out at once."""
        try:
            return operation()
        except CodeModeError:
            self._flush()
            raise

    def _arm(self, request_id: int, operation: str, allowance: float) -> None:
        """Give the host ``response_timeout + allowance`` seconds to answer ``request_id``."""
        self._deadlines[request_id] = self._loop.call_later(
            self._response_timeout + allowance, self._overdue, request_id, operation, allowance
        )

    def _disarm(self, request_id: int) -> None:
        handle = self._deadlines.pop(request_id, None)
        if handle is not None:
            handle.cancel()

    def _overdue(self, request_id: int, operation: str, allowance: float) -> None:
        del self._deadlines[request_id]
        if self._protocol.held_back(request_id) or self._notifying:
            # A held-back wait has not reached the host yet (§9.4): its time starts once sent.
            # A host that waits for a notification of ours to be delivered (the cell's yield
            # waits for it) is not silent: its time starts again. A tool call of ours holds
            # nothing back: the cell yields on time while it runs.
            self._arm(request_id, operation, allowance)
            return
        self._protocol.answer_overdue(request_id, operation)
        self._flush()

    def _register(self, request_id: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        self._futures[request_id] = future
        return future

    async def _answer(self, request_id: int) -> Any:
        """Send what the machine queued for ``request_id`` and await its answer; a caller that
        goes away cancels the request (the machine decides what that means on the wire)."""
        future = self._register(request_id)
        self._flush()
        try:
            await self._pump.drain()  # back-pressure for callers
            return await future
        except asyncio.CancelledError:
            self._cancel(request_id)
            raise

    def _cancel(self, request_id: int) -> None:
        # After an execution/started that raced the cancellation this is the initial-response
        # future, orphaned now: the machine discards that answer.
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._protocol.cancel(request_id)
        self._flush()

    def _abandon(self, session_id: str, cell_id: CellId, request_id: int) -> None:
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._protocol.abandon_cell(session_id, cell_id, request_id)
        self._flush()

    def _schedule(self, function: Callable[..., None], *args: Any) -> None:
        # Abandonment may run from a finalizer (any time, even inside the machine): defer it.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(function, *args)

    def _apply(self, event: ev.ClientEvent) -> None:
        futures = self._futures
        if isinstance(event, ev.CallbackRequested):
            self._run_callback(event)
        elif isinstance(event, ev.CallbackCancelled):
            token = self._tokens.get(event.delegate_id)
            if token is not None:
                token.cancel()
        elif isinstance(event, ev.CellClosed):
            self._cell_closed(event.session_id, event.cell_id)
        elif isinstance(event, ev.CellStarted):
            context = self._execute_contexts.pop(event.request_id, None)
            if context is not None:
                self._cell_contexts[(event.session_id, event.cell_id)] = context
            future = futures.pop(event.request_id, None)
            initial: asyncio.Future[RuntimeResponse] = self._loop.create_future()
            futures[event.request_id] = initial
            _resolve(future, (event.cell_id, initial))
        elif isinstance(event, ev.InitialResponse):
            self._disarm(event.request_id)
            _resolve(futures.pop(event.request_id, None), event.response)
        elif isinstance(event, ev.WaitAnswered):
            self._disarm(event.request_id)
            _resolve(futures.pop(event.request_id, None), event.outcome)
        elif isinstance(event, ev.SessionOpened | ev.SessionShutDown):
            self._disarm(event.request_id)
            _resolve(futures.pop(event.request_id, None), None)
        elif isinstance(event, ev.OperationFailed):
            self._disarm(event.request_id)
            future = futures.pop(event.request_id, None)
            error_type = ConnectionClosed if event.connection_lost else CodeModeError
            if future is not None and not future.done():
                future.set_exception(error_type(event.message))
                future.exception()  # a caller that went away must not trigger "never retrieved"
        elif isinstance(event, ev.SessionForgotten):
            self._delegates.pop(event.session_id, None)
            self._sessions.pop(event.session_id, None)
        elif isinstance(event, ev.ConnectionEnded):
            self._connection_ended(event.reason or "")
        elif isinstance(event, ev.HandshakeComplete):
            _resolve(self._handshake_replied, None)

    def _connection_ended(self, reason: str) -> None:
        self._dead.set()
        for handle in self._deadlines.values():
            handle.cancel()
        self._deadlines.clear()
        _resolve(self._handshake_replied, None)
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

    async def _read_once(self) -> None:
        if not await self._pump.receive():
            status = None if self._exit_status is None else await self._exit_status()
            if status is None:
                self._protocol.receive_eof()
            else:
                self._protocol.host_exited(status)
            self._flush()

    async def _read_loop(self) -> None:
        try:
            while self._protocol.is_alive():
                await self._read_once()
        except asyncio.CancelledError:
            self._protocol.close()
            self._flush()
            raise
        except Exception as error:  # a bug here must not leave callers hanging
            logger.exception("the V1 client reader failed")
            self._protocol.read_failed(describe(error))
            self._flush()

    # -- callbacks -------------------------------------------------------------------------------

    def _run_callback(self, event: ev.CallbackRequested) -> None:
        delegate = self._delegates.get(event.session_id, _NOOP_DELEGATE)
        token = CancellationToken()
        delegate_id = event.delegate_id
        self._tokens[delegate_id] = token
        callback = event.callback
        if isinstance(callback, ev.NotificationCallback):
            cell_id = callback.cell_id
            call = delegate.notify(callback.call_id, cell_id, callback.text, token)
        else:
            cell_id = callback.invocation.cell_id
            call = delegate.invoke_tool(callback.invocation, token)

        task = serve_callback(
            call,
            partial(self._settle, delegate_id),
            notification=isinstance(callback, ev.NotificationCallback),
            context=self._cell_contexts.get((event.session_id, cell_id)),
        )
        if task is not None:
            self._callback_tasks[delegate_id] = task
            if isinstance(callback, ev.NotificationCallback):
                self._notifying.add(delegate_id)

    def _settle(self, delegate_id: int, result: CallbackResult) -> None:
        self._tokens.pop(delegate_id, None)
        self._callback_tasks.pop(delegate_id, None)
        self._notifying.discard(delegate_id)
        self._protocol.finish_callback(delegate_id, result)
        self._flush()

    def _cell_closed(self, session_id: str, cell_id: CellId) -> None:
        delegate = self._delegates.get(session_id)
        context = self._cell_contexts.pop((session_id, cell_id), None)
        if delegate is not None:
            try:
                run_in(context, partial(delegate.cell_closed, cell_id))
            except Exception:
                logger.exception("cell_closed(%s) failed", cell_id)
        session = self._sessions.get(session_id)
        if session is not None:
            session._cells_changed.set()


def _resolve(future: asyncio.Future[Any] | None, value: object) -> None:
    if future is not None and not future.done():
        future.set_result(value)


class RemoteSession(CodeModeSession):
    """A :class:`~codemode.session.CodeModeSession` served by a V1 host.

    It behaves like the embedded session for its caller (§1.5): ``execute`` returns at admission,
    abandoning a :class:`StartedCell` terminates the cell, cancelling ``wait`` only retires the
    observation, cancelled ``terminate``/``shutdown`` complete in the background. Protocol V1 has
    no early yield: :meth:`StartedCell.yield_early` raises ``CodeModeError``. Once the
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
        check_execute_request(request)
        return await self._connection._execute(self, request)

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        """Observe a cell for up to ``request.yield_time_ms`` (V1 has no early yield: an
        ``early_yield`` already set raises, one set later has no effect)."""
        check_wait_request(request)
        if early_yield is not None and early_yield.is_set():
            raise CodeModeError(EARLY_YIELD_UNSUPPORTED)
        return await self._connection._wait(self, request)

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        """Stop a cell and return its final outcome."""
        check_cell_id(cell_id)
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
    exit_status: ExitStatus | None = None,
    wire_revision: WireRevision | str = WireRevision.PINNED,
    response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
) -> V1ClientConnection:
    """Handshake over ``transport`` and start the reader; the entry point for every carrier.

    ``dual`` lists ``dual-websocket-v1`` in the hello; when the host grants it, ``open_bulk(token)``
    must open the bulk socket (C6 otherwise). ``wire_revision`` (``pinned`` or ``latest``) is the
    shape of runtime responses accepted from the host; the handshake is the same in both.
    ``response_timeout`` is how long past its runtime allowance a request waits for its answer.
    """
    connection = V1ClientConnection(
        transport,
        dual=dual,
        exit_status=exit_status,
        wire_revision=wire_revision,
        response_timeout=response_timeout,
    )
    await connection.handshake(timeout=handshake_timeout, open_bulk=open_bulk)
    connection.start()
    return connection
