"""Serve sessions over one Protocol V1 connection: transport ⇄ :class:`HostConnection` ⇄ runtime.

The glue reads frames, lets the state machine decide, runs the resulting operations on sessions of
a :class:`~codemode.protocol.session.CodeModeSessionProvider` (normally the embedded runtime) and
writes what the state machine says to write. Each session gets a :class:`_HostDelegate` that turns
the runtime's nested tool calls and notifications into callbacks to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Final, TypeVar

from codemode.errors import CodeModeError, FrameError, ProtocolError
from codemode.protocol.constants import (
    CALLBACK_GRACE,
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    MAX_PENDING_DELEGATE_CALLS,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
    SHUTDOWN_TIMEOUT,
)
from codemode.protocol.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
)
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    RuntimeResponse,
    WaitOutcome,
)
from codemode.protocol.v1.codec import MessageDecoder, encode_frame
from codemode.protocol.v1.conversions import nested_tool_call_to_wire
from codemode.protocol.v1.host_state import (
    CANCELLED,
    CancelOperation,
    HostAction,
    HostConnection,
    OpenSession,
    ResolveCallback,
    Send,
    StartExecute,
    StartShutdown,
    StartTerminate,
    StartWait,
)
from codemode.protocol.v1.lanes import Lane, lane_of
from codemode.protocol.v1.messages import (
    ClientToHost,
    ConnectionRejected,
    DelegateRequest,
    DelegateRequestMessage,
    DelegateResponse,
    ExecuteInitialResponse,
    HostToClient,
    NotificationDelivered,
    NotificationSend,
    OperationResponse,
    ToolInvoke,
    ToolResult,
    WireError,
    WireOk,
    message_type,
)
from codemode.protocol.v1.revision import WireRevision
from codemode.transports.base import FrameTransport, TransportError

__all__ = ["HostOptions", "serve_v1_connection"]

logger = logging.getLogger("codemode.host")
T = TypeVar("T")

_CLIENT_MESSAGES: Final = MessageDecoder[ClientToHost](ClientToHost)
CALLBACK_LIMIT: Final = (
    f"code-mode host exceeded the limit of {MAX_PENDING_DELEGATE_CALLS} pending delegate calls"
)
INVALID_TOOL_RESULT: Final = "code-mode client returned an invalid tool result"
INVALID_NOTIFICATION_RESULT: Final = "code-mode client returned an invalid notification result"
CLIENT_CLOSED: Final = "code-mode client connection closed"


@dataclass(frozen=True, slots=True)
class HostOptions:
    """Limits, capabilities and wire revision of a V1 host (``codemode host`` flags of the same
    names). With ``wire_revision=latest`` runtime responses carry ``code_mode_host_duration_ns``
    (measured here, from the request's arrival to its answer) and ``result_buffered_for_ns``
    (what the session reports: how long a completion waited for its observer)."""

    max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS
    max_active_cells: int = DEFAULT_MAX_ACTIVE_CELLS
    capabilities: frozenset[str] = frozenset({SESSION_RESOURCE_LIMITS_CAPABILITY})
    wire_revision: WireRevision = WireRevision.PINNED


class _HostDelegate(CodeModeSessionDelegate):
    """A session's delegate on the host: every callback goes to the client."""

    def __init__(self, served: _ServedConnection, session_id: str) -> None:
        self._served = served
        self._session_id = session_id

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        request = ToolInvoke(nested_tool_call_to_wire(invocation))
        result = await self._served.callback(
            self._session_id, invocation.cell_id, request, cancellation
        )
        if result is None:
            raise CodeModeError(CALLBACK_LIMIT)
        if isinstance(result, WireError):
            raise CodeModeError(result.message)
        if not isinstance(result.value, ToolResult):
            raise CodeModeError(INVALID_TOOL_RESULT)
        return result.value.result

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        request = NotificationSend(call_id, str(cell_id), text)
        result = await self._served.callback(self._session_id, cell_id, request, cancellation)
        if result is None:
            logger.warning("failed to deliver code mode notification: %s", CALLBACK_LIMIT)
            return
        if isinstance(result, WireError):
            raise CodeModeError(result.message)
        if not isinstance(result.value, NotificationDelivered):
            raise CodeModeError(INVALID_NOTIFICATION_RESULT)

    def cell_closed(self, cell_id: CellId) -> None:
        self._served.cell_closed(self._session_id, cell_id)


class _ServedConnection:
    def __init__(
        self,
        transport: FrameTransport,
        provider: CodeModeSessionProvider,
        state: HostConnection,
    ) -> None:
        self._transport = transport
        self._provider = provider
        self._state = state
        self._dual = transport.dual
        # A session id maps to a future: requests pipelined behind session/open wait for it.
        self._sessions: dict[str, asyncio.Future[CodeModeSession]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._cancellable: dict[int, asyncio.Future[Any]] = {}
        self._callbacks: dict[int, asyncio.Future[WireOk[DelegateResponse] | WireError]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._ended = False
        self.failure: str | None = None
        self._timed = state.wire_revision is WireRevision.LATEST

    # -- writing -----------------------------------------------------------------------------------

    def _send_all(self, sends: list[Send]) -> None:
        for send in sends:
            self._write(send.message)

    def _write(self, message: HostToClient) -> None:
        if self._ended:
            return
        try:
            frame = encode_frame(message)
        except FrameError as error:
            replacement = self._oversize(message, error)
            if replacement is None:
                return
            frame = encode_frame(replacement)
        try:
            self._transport.send(frame, lane_of(message) if self._dual else Lane.CONTROL)
        except TransportError as error:
            self._end(f"failed to write code-mode client message: {error}")
            # The reader may be waiting for a client that says nothing more: closing wakes it.
            closing = asyncio.ensure_future(self._close_transport())
            self._background.add(closing)
            closing.add_done_callback(self._background.discard)

    def _oversize(self, message: HostToClient, error: FrameError) -> HostToClient | None:
        detail = f"code-mode host response exceeds the IPC frame limit: {error}"
        if isinstance(message, OperationResponse):
            return OperationResponse(message.id, WireError(detail))
        if isinstance(message, ExecuteInitialResponse):
            return ExecuteInitialResponse(message.id, WireError(detail))
        if isinstance(message, DelegateRequestMessage):
            future = self._callbacks.pop(message.id, None)
            self._send_all(self._state.callback_unsent(message.id))
            if future is not None and not future.done():
                future.set_exception(
                    CodeModeError(
                        f"code-mode delegate request exceeds the IPC frame limit: {error}"
                    )
                )
            return None
        logger.error("cannot encode %s: %s", type(message).__name__, error)
        return None

    # -- reading -----------------------------------------------------------------------------------

    async def run(self) -> None:
        while not self._ended:
            try:
                received = await self._transport.receive()
            except FrameError as error:
                self._end(f"failed to read code-mode client message: {error}")
                return
            except TransportError as error:
                self._end(f"failed to read code-mode client message: {error}")
                return
            if received is None:
                self._end(None)
                return
            payload, _lane = received
            try:
                message = _CLIENT_MESSAGES.decode(payload)
                if self._dual and lane_of(message) is not _lane:
                    raise ProtocolError(
                        f"code-mode message {message_type(message)} is not allowed on the {_lane.value} socket"
                    )
                actions = self._state.receive(message)
            except FrameError as error:
                self._end(f"failed to read code-mode client message: {error}")
                return
            except ProtocolError as error:
                self._end(str(error))
                return
            self._perform(actions)

    def _perform(self, actions: list[HostAction]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._write(action.message)
            elif isinstance(action, ResolveCallback):
                future = self._callbacks.pop(action.delegate_id, None)
                if future is not None and not future.done():
                    future.set_result(action.result)
            elif isinstance(action, CancelOperation):
                inner = self._cancellable.get(action.request_id)
                if inner is not None:
                    inner.cancel()
            elif isinstance(action, OpenSession):
                self._spawn(action.request_id, self._open(action))
            elif isinstance(action, StartExecute):
                self._spawn(action.request_id, self._execute(action, time.monotonic_ns()))
            elif isinstance(action, StartWait):
                self._spawn(action.request_id, self._wait(action, time.monotonic_ns()))
            elif isinstance(action, StartTerminate):
                self._spawn(action.request_id, self._terminate(action, time.monotonic_ns()))
            elif isinstance(action, StartShutdown):
                self._spawn(action.request_id, self._shutdown(action))

    def _spawn(self, request_id: int, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks[request_id] = task
        task.add_done_callback(lambda done: self._operation_done(request_id, done))

    def _operation_done(self, request_id: int, task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)
        if task.cancelled() or (error := task.exception()) is None:
            return
        # A bug must not leave the client waiting forever: answer with what went wrong.
        logger.error("code-mode host: request %s failed", request_id, exc_info=error)
        message = f"code-mode host internal error: {type(error).__name__}: {error}"
        self._send_all(self._state.operation_failed(request_id, message))

    # -- operations --------------------------------------------------------------------------------

    async def _open(self, action: OpenSession) -> None:
        delegate = _HostDelegate(self, action.session_id)
        opened: asyncio.Future[CodeModeSession] = asyncio.get_running_loop().create_future()
        self._sessions[action.session_id] = opened
        try:
            session = await self._provider.create_session_with_limits(delegate, action.limits)
        except CodeModeError as error:
            del self._sessions[action.session_id]
            opened.set_exception(CodeModeError(f"unknown code-mode session {action.session_id}"))
            opened.exception()
            self._send_all(self._state.operation_failed(action.request_id, error.message))
            return
        opened.set_result(session)
        if self._ended:
            await session.shutdown()
            return
        self._send_all(self._state.session_opened(action.request_id))

    async def _session(self, session_id: str) -> CodeModeSession:
        opening = self._sessions.get(session_id)
        if opening is None:
            raise CodeModeError(f"unknown code-mode session {session_id}")
        return await asyncio.shield(opening)

    async def _run_cancellable(
        self,
        request_id: int,
        session_id: str,
        operation: Callable[[CodeModeSession], Awaitable[T]],
    ) -> T | None:
        """Run an operation the client may cancel; ``None`` once its error answer was sent."""
        try:
            session = await self._session(session_id)
        except CodeModeError as error:
            self._send_all(self._state.operation_failed(request_id, error.message))
            return None
        if self._state.cancelled(request_id):  # cancelled while its session was opening
            self._send_all(self._state.operation_failed(request_id, CANCELLED))
            return None
        inner = asyncio.ensure_future(operation(session))
        self._cancellable[request_id] = inner
        try:
            return await inner
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the connection ended: this task itself was cancelled
            message = CANCELLED
        except CodeModeError as error:
            message = error.message
        finally:
            self._cancellable.pop(request_id, None)
        self._send_all(self._state.operation_failed(request_id, message))
        return None

    def _timed_response(self, response: RuntimeResponse, since_ns: int) -> RuntimeResponse:
        """``response`` with the host-side duration of its operation (``latest`` only)."""
        if not self._timed:
            return response
        return replace(response, host_duration_ns=time.monotonic_ns() - since_ns)

    def _timed_outcome(self, outcome: WaitOutcome, since_ns: int) -> WaitOutcome:
        if not self._timed:
            return outcome
        return type(outcome)(self._timed_response(outcome.response, since_ns))

    async def _execute(self, action: StartExecute, since_ns: int) -> None:
        request_id = action.request_id
        started = await self._run_cancellable(
            request_id, action.session_id, lambda session: session.execute(action.request)
        )
        if started is None:
            return
        sends = self._state.execution_started(request_id, started.cell_id)
        if sends is None:  # cancelled while being admitted: abandon the cell
            started.cancel()
            self._send_all(self._state.operation_failed(request_id, CANCELLED))
            return
        self._send_all(sends)
        try:
            response = await started.initial_response()
        except CodeModeError as error:
            self._send_all(self._state.operation_failed(request_id, error.message))
            return
        response = self._timed_response(response, since_ns)
        self._send_all(self._state.initial_response(request_id, response))

    async def _wait(self, action: StartWait, since_ns: int) -> None:
        outcome = await self._run_cancellable(
            action.request_id, action.session_id, lambda session: session.wait(action.request)
        )
        if outcome is not None:
            outcome = self._timed_outcome(outcome, since_ns)
            self._send_all(self._state.wait_completed(action.request_id, outcome))

    async def _terminate(self, action: StartTerminate, since_ns: int) -> None:
        try:
            session = await self._session(action.session_id)
            outcome = await session.terminate(action.cell_id)
        except CodeModeError as error:
            self._send_all(self._state.operation_failed(action.request_id, error.message))
            return
        outcome = self._timed_outcome(outcome, since_ns)
        self._send_all(self._state.wait_completed(action.request_id, outcome))

    async def _shutdown(self, action: StartShutdown) -> None:
        try:
            session = await self._session(action.session_id)
        except CodeModeError:
            session = None
        self._sessions.pop(action.session_id, None)
        if session is not None:
            await session.shutdown()
        self._send_all(self._state.session_shut_down(action.request_id))

    # -- callbacks ---------------------------------------------------------------------------------

    async def callback(
        self,
        session_id: str,
        cell_id: CellId,
        request: DelegateRequest,
        cancellation: CancellationToken,
    ) -> WireOk[DelegateResponse] | WireError | None:
        """Send one callback and await the client's answer (``None``: over the pending cap)."""
        if self._ended:
            raise CodeModeError(CLIENT_CLOSED)
        delegate_id, sends = self._state.start_callback(session_id, cell_id, request)
        if delegate_id is None:
            return None
        future: asyncio.Future[WireOk[DelegateResponse] | WireError]
        future = asyncio.get_running_loop().create_future()
        self._callbacks[delegate_id] = future
        self._send_all(sends)
        cancellation.add_callback(lambda: self._revoke(delegate_id))
        return await future

    def _revoke(self, delegate_id: int) -> None:
        future = self._callbacks.pop(delegate_id, None)
        self._send_all(self._state.revoke_callback(delegate_id))
        if future is not None and not future.done():
            # The client's task may still be running (its answer is suppressed): the callback
            # counts as finished after the runtime's grace, as a local delegate would.
            asyncio.get_running_loop().call_later(CALLBACK_GRACE, _fail_revoked, future)

    def cell_closed(self, session_id: str, cell_id: CellId) -> None:
        self._send_all(self._state.cell_closed(session_id, cell_id))

    # -- the end -----------------------------------------------------------------------------------

    def _end(self, failure: str | None) -> None:
        if self._ended:
            return
        self._ended = True
        self.failure = failure
        if failure is not None:
            logger.warning("%s", failure)
        requests, _callbacks = self._state.connection_lost()
        for request_id in requests:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
        pending, self._callbacks = self._callbacks, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(CodeModeError(CLIENT_CLOSED))
                future.exception()

    async def finish(self) -> bool:
        """Shut every session down (bounded by ``SHUTDOWN_TIMEOUT``); True if it completed."""
        openings, self._sessions = list(self._sessions.values()), {}
        work = [
            opening.result().shutdown()
            for opening in openings
            if opening.done() and not opening.cancelled() and opening.exception() is None
        ]
        tasks = list(self._tasks.values())
        try:
            await asyncio.wait_for(
                asyncio.gather(*work, *tasks, return_exceptions=True), SHUTDOWN_TIMEOUT
            )
        except TimeoutError:
            logger.error("code-mode host: cleanup after the connection ended timed out")
            return False
        await self._close_transport()
        return True

    async def _close_transport(self) -> None:
        with contextlib.suppress(TransportError, OSError):
            await self._transport.close()


def _fail_revoked(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(CodeModeError("code-mode callback was revoked"))
        future.exception()


async def serve_v1_connection(
    transport: FrameTransport,
    provider: CodeModeSessionProvider,
    options: HostOptions | None = None,
) -> bool:
    """Serve one V1 connection until it ends; True after a clean end (EOF, cleanup done)."""
    options = options or HostOptions()
    capabilities = set(options.capabilities)
    state = HostConnection(
        capabilities=capabilities,
        max_in_flight_requests=options.max_in_flight_requests,
        max_active_cells=options.max_active_cells,
        wire_revision=options.wire_revision,
    )
    try:
        first = await transport.receive()
        if first is None:
            await transport.close()
            return True  # EOF before any byte: close silently
        hello = _CLIENT_MESSAGES.decode(first[0])
    except (FrameError, TransportError) as error:
        logger.warning("failed to read code-mode client hello: %s", error)
        await transport.close()
        return False
    reply = state.negotiate(hello)
    try:
        transport.send(encode_frame(reply))
        await transport.drain()
    except TransportError as error:
        logger.warning("failed to write code-mode client message: %s", error)
        await transport.close()
        return False
    if isinstance(reply, ConnectionRejected):
        await transport.close()
        return True
    served = _ServedConnection(transport, provider, state)
    await served.run()
    clean = await served.finish()
    return clean and served.failure is None
