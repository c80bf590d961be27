"""Serve sessions over one Protocol V1 connection: transport ⇄ :class:`HostProtocol` ⇄ runtime.

The glue pumps bytes between a transport and a :class:`~codemode.protocol.v1.host.HostProtocol`,
runs the operations the machine asks for on sessions of a
:class:`~codemode.session.CodeModeSessionProvider` (normally the embedded runtime) and reports
their results back. Each session gets a :class:`_HostDelegate` that hands the runtime's nested
tool calls and notifications to the machine as callbacks to the client. Every protocol decision is
the machine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, TypeVar, cast

import msgspec

from codemode.errors import CodeModeError, FrameError, FrameErrorKind
from codemode.protocol import pieces
from codemode.protocol.constants import (
    BULK_PAIRING_TIMEOUT,
    CALLBACK_GRACE,
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    MAX_FRAME_BYTES,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
    SHUTDOWN_TIMEOUT,
)
from codemode.protocol.delegation import CallbackFailed, CallbackResult, ToolReturned
from codemode.protocol.options import checked_count
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    InputText,
    Result,
    RuntimeResponse,
    WaitOutcome,
)
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1 import texts
from codemode.protocol.v1.host import HostProtocol
from codemode.protocol.v1.revision import WireRevision
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    start_eagerly,
)
from codemode.transports.base import FrameTransport, TransportError, describe
from codemode.transports.pump import Pump

__all__ = ["HostOptions", "V1HostConnection", "serve_v1_connection"]

logger = logging.getLogger("codemode.host")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HostOptions:
    """Limits, capabilities and wire revision of a V1 host (``codemode host`` flags of the same
    names). With ``wire_revision=latest`` runtime responses carry ``code_mode_host_duration_ns``
    (from the request's arrival to its answer) and ``result_buffered_for_ns`` (what the session
    reports: how long a completion waited for its observer); ``"auto"`` lets each client's hello
    choose (``revision_for_hello``)."""

    max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS
    max_active_cells: int = DEFAULT_MAX_ACTIVE_CELLS
    capabilities: frozenset[str] = frozenset({SESSION_RESOURCE_LIMITS_CAPABILITY})
    wire_revision: WireRevision | Literal["auto"] = WireRevision.PINNED

    def __post_init__(self) -> None:
        checked_count("max_in_flight_requests", self.max_in_flight_requests)
        checked_count("max_active_cells", self.max_active_cells)

    def protocol(self) -> HostProtocol:
        """A fresh host machine with these options."""
        return HostProtocol(
            capabilities=self.capabilities,
            max_in_flight_requests=self.max_in_flight_requests,
            max_active_cells=self.max_active_cells,
            wire_revision=self.wire_revision,
            ordered_refusals=True,
            large_frames_apart=True,
        )


class _HostDelegate(CodeModeSessionDelegate):
    """A session's delegate on the host: every callback goes to the client.

    Its callbacks are futures the client's answers resolve (:class:`_Settlement`): the runtime
    settles them from their done callbacks, with no task or coroutine per nested call.
    """

    def __init__(self, served: V1HostConnection, session_id: str) -> None:
        self._served = served
        self._session_id = session_id

    def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> _Settlement:
        session_id = self._session_id
        if not pieces.heavy(invocation.input):
            return self._served.callback(
                lambda protocol: protocol.start_tool_call(session_id, invocation), cancellation
            )
        encoding = self._served.encode_off_loop(invocation.input)

        def start(protocol: HostProtocol) -> int:
            value, excess = _encoded(encoding, invocation.input)
            call = replace(invocation, input=value)
            return protocol.start_tool_call(session_id, call, excess=excess)

        return self._served.callback(start, cancellation, encoding)

    def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> _Settlement:
        session_id = self._session_id
        if len(text) <= pieces.PIECE:
            return self._served.callback(
                lambda protocol: protocol.start_notification(session_id, call_id, cell_id, text),
                cancellation,
            )
        encoding = self._served.encode_off_loop(text)

        def start(protocol: HostProtocol) -> int:
            value, excess = _encoded(encoding, text)
            return protocol.start_notification(session_id, call_id, cell_id, value, excess=excess)

        return self._served.callback(start, cancellation, encoding)

    def cell_closed(self, cell_id: CellId) -> None:
        self._served.protocol.cell_closed(self._session_id, cell_id)
        self._served.flush()


class _Settlement:
    """How one callback to the client ended: a future (the ``asyncio.Future`` protocol) of the
    tool's JSON, failed with :class:`CodeModeError` and the client's text when the callback failed.

    It differs from an :class:`asyncio.Future` in one respect: resolved from a plain loop
    callback — the client's answer, decoded in the ``data_received`` of a pushing transport — it
    runs its done callbacks *at once*, so the runtime settles the nested call in the iteration
    that read the answer, instead of one ``call_soon`` later. Resolved from inside a task (a
    pulling transport's reader), it schedules them as a future would.
    """

    __slots__ = ("_asyncio_future_blocking", "_callbacks", "_loop", "_result", "_state")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._asyncio_future_blocking = False
        self._callbacks: list[tuple[Callable[[Any], object], contextvars.Context | None]] = []
        self._result: CallbackResult | None = None
        self._state = "pending"  # or "done", "cancelled"

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def done(self) -> bool:
        return self._state != "pending"

    def cancelled(self) -> bool:
        return self._state == "cancelled"

    def result(self) -> JSON:
        error = self.exception()
        if error is not None:
            raise error
        return self._result.value if isinstance(self._result, ToolReturned) else None

    def exception(self) -> BaseException | None:
        if self._state == "cancelled":
            raise asyncio.CancelledError
        if self._result is None:
            raise asyncio.InvalidStateError("the callback has not ended")
        if isinstance(self._result, CallbackFailed):
            return CodeModeError(self._result.message)
        return None

    def add_done_callback(
        self, callback: Callable[[Any], object], *, context: contextvars.Context | None = None
    ) -> None:
        if self._state != "pending":
            self._loop.call_soon(callback, self, context=context)
        else:
            self._callbacks.append((callback, context))

    def remove_done_callback(self, callback: Callable[[Any], object]) -> int:
        before = len(self._callbacks)
        self._callbacks = [entry for entry in self._callbacks if entry[0] != callback]
        return before - len(self._callbacks)

    def cancel(self, msg: object = None) -> bool:
        if self._state != "pending":
            return False
        self._state = "cancelled"
        self._schedule_callbacks()
        return True

    def set_result(self, result: CallbackResult) -> None:
        if self._state != "pending":
            return
        self._state, self._result = "done", result
        if asyncio.current_task(self._loop) is not None:
            self._schedule_callbacks()  # a task is running: one that awaits this cannot step now
            return
        callbacks, self._callbacks = self._callbacks, []
        for callback, context in callbacks:
            if context is None:
                callback(self)
            else:
                context.run(callback, self)

    def _schedule_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback, context in callbacks:
            self._loop.call_soon(callback, self, context=context)

    def __await__(self) -> Generator[Any, None, JSON]:
        if self._state == "pending":
            self._asyncio_future_blocking = True
            yield self
        return self.result()


class _OpenFailed(Exception):
    """The session a request was for never opened."""


async def _at_once(call: Coroutine[Any, Any, T]) -> list[T]:
    """``[value]`` when ``call`` finishes in its first step, run now (what it raises there is
    raised); else ``[]``, once it was cancelled and has cleaned up (an observation it attached
    is detached without losing anything)."""
    settled: list[T] = []
    failed: list[BaseException] = []

    async def run() -> None:
        try:
            settled.append(await call)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # raised again below, in the caller
            failed.append(error)

    task = start_eagerly(run())
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if failed:
        raise failed[0]
    return settled


@dataclass(eq=False, slots=True)
class _HeldBack:
    """A callback not yet issued: the client does not take what was written, or its input is
    being encoded off the event loop (``encoding``)."""

    start: Callable[[HostProtocol], int]
    settlement: _Settlement
    cancellation: CancellationToken
    encoding: asyncio.Future[bytearray | int] | None = None
    issued: bool = False

    @property
    def ready(self) -> bool:
        return self.encoding is None or self.encoding.done()


_Text = TypeVar("_Text", str, JSON)


def _encoded(encoding: asyncio.Future[bytearray | int], value: _Text) -> tuple[_Text, int]:
    """What stands for ``value`` in its callback's message once ``encoding`` (:func:`pieces.encode`
    of it) is done, and the bytes it then lacks (see :meth:`HostProtocol.start_tool_call`).
    Unfinished (the connection ended first) or failed, the value itself: the machine refuses
    the callback, or its encode gives the error it gives."""
    if not encoding.done() or encoding.cancelled() or encoding.exception() is not None:
        return value, 0
    encoded = encoding.result()
    # A msgspec.Raw is written as it is, wherever a message holds it (the types say str or JSON).
    if isinstance(encoded, int):
        return cast(_Text, msgspec.Raw(b"0")), encoded - 1
    return cast(_Text, msgspec.Raw(encoded)), 0


async def _texts_encoded(response: RuntimeResponse) -> tuple[RuntimeResponse, int]:
    """``response`` and the bytes it lacks: its texts encoded on a worker thread when they are
    long, as a large callback input is (:meth:`V1HostConnection.encode_off_loop`)."""
    total = len(response.error_text or "") if isinstance(response, Result) else 0
    for item in response.content_items:
        if isinstance(item, InputText):
            total += len(item.text)
    if total <= pieces.PIECE:
        return response, 0
    return await asyncio.to_thread(_with_encoded_texts, response)


async def _outcome_encoded(outcome: WaitOutcome) -> tuple[WaitOutcome, int]:
    response, excess = await _texts_encoded(outcome.response)
    return (outcome if response is outcome.response else type(outcome)(response)), excess


def _with_encoded_texts(response: RuntimeResponse) -> tuple[RuntimeResponse, int]:
    """Each text stands in the response as a ``msgspec.Raw``; once they pass a frame's size,
    those that follow are only measured (the response is refused), each standing in as ``0``."""
    room = MAX_FRAME_BYTES
    excess = 0

    def encoded(text: str) -> str:
        nonlocal room, excess
        if len(text) < _ENCODED_TEXT_CHARS:
            return text
        value = pieces.encode(text, max(room, 0))
        if isinstance(value, int):
            room, excess = -1, excess + value - 1
            return cast(str, msgspec.Raw(b"0"))
        room -= len(value)
        return cast(str, msgspec.Raw(value))

    items = [
        InputText(encoded(item.text)) if isinstance(item, InputText) else item
        for item in response.content_items
    ]
    if isinstance(response, Result) and response.error_text is not None:
        error_text = encoded(response.error_text)
        return replace(response, content_items=items, error_text=error_text), excess
    return replace(response, content_items=items), excess


#: Texts shorter than this stay as they are in a response whose texts are encoded apart.
_ENCODED_TEXT_CHARS: Final = 64


class V1HostConnection:
    """One V1 connection served to a client: the glue between a transport, a
    :class:`HostProtocol` and a session provider. :func:`serve_v1_connection` runs one.

    ``pair_bulk(token)`` returns once the bulk socket of a dual connection has arrived (carriers
    that grant ``dual-websocket-v1`` must give one); past ``BULK_PAIRING_TIMEOUT`` the connection
    ends (L9).
    """

    def __init__(
        self,
        transport: FrameTransport,
        provider: CodeModeSessionProvider,
        protocol: HostProtocol,
        *,
        pair_bulk: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._transport = transport
        self._pair_bulk = pair_bulk
        self._provider = provider
        self.protocol = protocol
        # A session id maps to a future: requests pipelined behind session/open wait for it.
        self._sessions: dict[str, asyncio.Future[CodeModeSession]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        # The tasks running a client-cancellable operation; those the client cancelled.
        self._cancellable: dict[int, asyncio.Task[Any]] = {}
        self._client_cancelled: set[int] = set()
        # Per session, the admission of the last execute not yet admitted or refused: a wait or
        # terminate that arrived after it looks at the session once it was (its cell exists).
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._callbacks: dict[int, _Settlement] = {}
        self._background: set[asyncio.Task[Any]] = set()
        # Callbacks that wait, in order, for a client that does not take what was written: held
        # here (their inputs counted by the runtime), not as frames in the write buffer, so that
        # one a cell gives up on (it ended) is never written at all.
        self._held_back: deque[_HeldBack] = deque()
        self._releasing: asyncio.Task[None] | None = None
        self._closing = False
        self._batch_pending = False
        self._release: asyncio.Handle | None = None
        # A large frame of the client's being decoded on a worker thread: reading waits for it.
        self._decoding: asyncio.Task[None] | None = None
        self._pump = Pump(transport, protocol, self._apply)
        self.flush = self._pump.flush

    # -- pumping -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Read until the connection ends. While the client does not take what was written,
        no more requests are read (what a client that stops reading costs stays bounded)."""
        pump, protocol = self._pump, self.protocol
        while not protocol.ended:
            decoding = self._decoding
            if decoding is not None:  # what follows a large frame is read once it was taken in
                await asyncio.wait((decoding,))
                continue
            if not await pump.receive():
                protocol.receive_eof()
                pump.flush()
            await pump.drain()

    def stop_admitting(self) -> None:
        """The host is shutting down: later requests are refused (H4); running work goes on."""
        self.protocol.stop_admitting()
        self.flush()

    async def _pair(self, token: str) -> None:
        pair_bulk = self._pair_bulk
        try:
            if pair_bulk is None:
                raise RuntimeError("this carrier cannot pair a bulk socket")
            async with asyncio.timeout(BULK_PAIRING_TIMEOUT):
                await pair_bulk(token)
        except Exception as error:
            logger.debug("bulk pairing failed: %s", error)
            self.protocol.bulk_not_established()
            self.flush()

    def _apply(self, event: ev.HostEvent) -> None:
        if isinstance(event, ev.CallbackResolved):
            future = self._callbacks.pop(event.delegate_id, None)
            if future is not None and not future.done():
                future.set_result(event.result)
        elif isinstance(event, ev.CancelOperation):
            task = self._cancellable.get(event.request_id)
            if task is not None and event.request_id not in self._client_cancelled:
                self._client_cancelled.add(event.request_id)
                task.cancel()
        elif isinstance(event, ev.OpenSession):
            self._spawn(event.request_id, self._open(event))
        elif isinstance(event, ev.StartExecute):
            admitted = asyncio.get_running_loop().create_future()
            self._admissions[event.session_id] = admitted
            self._spawn(event.request_id, self._execute(event, admitted))
        elif isinstance(event, ev.StartWait):
            admission = self._admissions.get(event.session_id)
            self._spawn(event.request_id, self._wait(event, admission))
        elif isinstance(event, ev.StartTerminate):
            admission = self._admissions.get(event.session_id)
            self._spawn(event.request_id, self._terminate(event, admission))
        elif isinstance(event, ev.StartShutdown):
            self._spawn(event.request_id, self._shutdown(event))
        elif isinstance(event, ev.ConnectionEnded):
            self._ended(event)
        elif isinstance(event, ev.LargeFrame):
            self._pump.pause()
            self._decoding = asyncio.ensure_future(self._decode_apart(event))
        elif event.negotiated.dual_websocket:  # HandshakeComplete
            token = event.negotiated.bulk_connection_token
            assert token is not None
            pairing = asyncio.ensure_future(self._pair(token))
            self._background.add(pairing)
            pairing.add_done_callback(self._background.discard)

    async def _decode_apart(self, event: ev.LargeFrame) -> None:
        """Decode a large frame of the client's on a worker thread, its long strings a piece at
        a time: one decode on the loop held every connection of this host for as long (66 MB of
        backslashes: 0.25-0.4 s). The machine holds what arrived meanwhile."""
        try:
            decoded = await asyncio.to_thread(event.payload.decode)
        except FrameError as error:
            decoded = error
        except Exception as error:  # not the frame's fault (MemoryError): reading it failed
            logger.exception("code-mode host: decoding a large frame failed")
            decoded = FrameError(FrameErrorKind.INVALID_JSON, describe(error))
        self._decoding = None
        self.protocol.receive_decoded(decoded)
        self.flush()

    def _spawn(self, request_id: int, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks[request_id] = task
        task.add_done_callback(lambda done: self._operation_done(request_id, done))
        # Answers leave in arrival order: a refusal the machine made while reading waits behind
        # the requests read before it, which answer in their tasks' first steps when they can
        # answer at once. Those steps run in arrival order, before this callback (moved behind
        # the last task spawned).
        if self._release is not None:
            self._release.cancel()
        self._release = asyncio.get_running_loop().call_soon(self._release_refusals)

    def _release_refusals(self) -> None:
        self._release = None
        if self.protocol.holds_refusals:
            self.protocol.release_refusals()
            self.flush()

    def _operation_done(self, request_id: int, task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)
        if task.cancelled() or (error := task.exception()) is None:
            return
        logger.error("code-mode host: request %s failed", request_id, exc_info=error)
        self.protocol.operation_crashed(request_id, error)
        self.flush()

    # -- operations --------------------------------------------------------------------------------

    async def _open(self, event: ev.OpenSession) -> None:
        delegate = _HostDelegate(self, event.session_id)
        opened: asyncio.Future[CodeModeSession] = asyncio.get_running_loop().create_future()
        self._sessions[event.session_id] = opened
        try:
            session = await self._provider.create_session_with_limits(delegate, event.limits)
        except CodeModeError as error:
            del self._sessions[event.session_id]
            opened.set_exception(_OpenFailed())
            opened.exception()
            self.protocol.operation_failed(event.request_id, error.message)
            self.flush()
            return
        opened.set_result(session)
        if self.protocol.ended:
            await session.shutdown()
            return
        self.protocol.session_opened(event.request_id)
        self.flush()

    async def _session(self, request_id: int, session_id: str) -> CodeModeSession | None:
        """The session (waiting for its open); ``None`` once the request was answered H5."""
        opening = self._sessions.get(session_id)
        try:
            if opening is None:
                raise _OpenFailed
            return await asyncio.shield(opening)
        except _OpenFailed:
            self.protocol.session_unavailable(request_id)
            self.flush()
            return None

    async def _run_cancellable(
        self,
        request_id: int,
        session_id: str,
        operation: Callable[[CodeModeSession], Coroutine[Any, Any, T]],
        *,
        settled_at_once: bool = False,
    ) -> T | None:
        """Run an operation the client may cancel; ``None`` once its error answer was sent.

        With ``settled_at_once``, an operation cancelled before it started (its cancel was read
        with it, or while its session was opening) still gives its outcome if it has one at once,
        without waiting for anything: as on the upstream host, which serves a wait of a missing
        cell before it reads the cancel that came with it."""
        session = await self._session(request_id, session_id)
        if session is None:
            return None
        protocol = self.protocol
        if protocol.cancelled(request_id):
            if settled_at_once:
                try:
                    outcome = await _at_once(operation(session))
                except CodeModeError as error:
                    protocol.operation_failed(request_id, error.message)
                    self.flush()
                    return None
                if outcome:
                    return outcome[0]
            protocol.operation_cancelled(request_id)
            self.flush()
            return None
        # Run in this task (no task of its own: the answer leaves in this step when it can); the
        # client's cancel cancels this task, told apart from the connection's end by
        # _client_cancelled and the count of cancel requests.
        task = asyncio.current_task()
        assert task is not None
        self._cancellable[request_id] = task
        try:
            return await operation(session)
        except asyncio.CancelledError:
            if request_id not in self._client_cancelled or task.cancelling() > 1:
                raise  # the connection ended: this task itself was cancelled
            task.uncancel()
            self._client_cancelled.discard(request_id)
            protocol.operation_cancelled(request_id)
        except CodeModeError as error:
            protocol.operation_failed(request_id, error.message)
        finally:
            self._cancellable.pop(request_id, None)
            if request_id in self._client_cancelled:
                # Cancelled, but the operation ended anyway (it did not see the cancellation
                # or swallowed it): take the request back so that it does not hit a later await.
                self._client_cancelled.discard(request_id)
                task.uncancel()
        self.flush()
        return None

    async def _execute(self, event: ev.StartExecute, admission: asyncio.Future[None]) -> None:
        request_id = event.request_id
        try:
            started = await self._run_cancellable(
                request_id, event.session_id, lambda session: session.execute(event.request)
            )
        finally:
            admission.set_result(None)
            if self._admissions.get(event.session_id) is admission:
                del self._admissions[event.session_id]
        if started is None:
            return
        protocol = self.protocol
        admitted = protocol.execution_started(request_id, started.cell_id)
        self.flush()
        if not admitted:  # cancelled while being admitted: abandon the cell
            started.cancel()
            return
        try:
            response, excess = await _texts_encoded(await started.initial_response())
        except CodeModeError as error:
            protocol.operation_failed(request_id, error.message)
        else:
            protocol.initial_response(request_id, response, excess)
        self.flush()

    @staticmethod
    async def _admitted(admission: asyncio.Future[None] | None) -> None:
        """Wait until an execute that arrived earlier for the same session was admitted."""
        if admission is not None and not admission.done():
            await asyncio.wait((admission,))

    async def _wait(self, event: ev.StartWait, admission: asyncio.Future[None] | None) -> None:
        await self._admitted(admission)
        outcome = await self._run_cancellable(
            event.request_id,
            event.session_id,
            lambda session: session.wait(event.request),
            settled_at_once=True,
        )
        if outcome is not None:
            self.protocol.wait_completed(event.request_id, *await _outcome_encoded(outcome))
            self.flush()

    async def _terminate(
        self, event: ev.StartTerminate, admission: asyncio.Future[None] | None
    ) -> None:
        await self._admitted(admission)
        session = await self._session(event.request_id, event.session_id)
        if session is None:
            return
        try:
            outcome, excess = await _outcome_encoded(await session.terminate(event.cell_id))
        except CodeModeError as error:
            self.protocol.operation_failed(event.request_id, error.message)
        else:
            self.protocol.wait_completed(event.request_id, outcome, excess)
        self.flush()

    async def _shutdown(self, event: ev.StartShutdown) -> None:
        opening = self._sessions.pop(event.session_id, None)
        session = None
        if opening is not None:
            with contextlib.suppress(_OpenFailed):
                session = await asyncio.shield(opening)
        if session is not None and self.protocol.session_idle(event.session_id):
            # No cell to wait for: answered at once, as upstream does (a session/open read with
            # it is answered after it); the engine is released afterwards, still in this task,
            # which the connection's end waits for.
            self.protocol.session_shut_down(event.request_id)
            self.flush()
            await session.shutdown()
            return
        if session is not None:
            await session.shutdown()
        self.protocol.session_shut_down(event.request_id)
        self.flush()

    # -- callbacks ---------------------------------------------------------------------------------

    def encode_off_loop(self, value: JSON) -> asyncio.Future[bytearray | int]:
        """Start :func:`pieces.encode` of a large callback input on a worker thread: escaped
        text encodes at 250-500 MB/s, and one call would hold the event loop every session of
        this host shares for as long (a tool input of 63 M backslashes: 0.5 s)."""
        return asyncio.get_running_loop().run_in_executor(
            None, pieces.encode, value, MAX_FRAME_BYTES
        )

    def callback(
        self,
        start: Callable[[HostProtocol], int],
        cancellation: CancellationToken,
        encoding: asyncio.Future[bytearray | int] | None = None,
    ) -> _Settlement:
        """Issue one callback through the machine; the future of how it ends. While the client
        does not take what was written, or an earlier callback's input is being encoded
        (``encoding``: this one's), callbacks wait in order and are issued as they can be."""
        settlement = _Settlement(asyncio.get_running_loop())
        if (
            encoding is not None
            or self._held_back
            or (self._transport.backlogged() and not self.protocol.ended)
        ):
            held = _HeldBack(start, settlement, cancellation, encoding)
            self._held_back.append(held)
            cancellation.add_callback(lambda: self._withdraw(held))
            if self._releasing is None:
                self._releasing = asyncio.ensure_future(self._release_held_back())
            return settlement
        self._issue(start, settlement, cancellation)
        return settlement

    def _issue(
        self,
        start: Callable[[HostProtocol], int],
        settlement: _Settlement,
        cancellation: CancellationToken,
    ) -> None:
        delegate_id = start(self.protocol)
        self._callbacks[delegate_id] = settlement
        self._flush_callbacks()
        if not settlement.done():
            cancellation.add_callback(lambda: self._revoke(delegate_id))

    def _withdraw(self, held: _HeldBack) -> None:
        # The runtime gave up on a callback the client never saw: it ends at once, unwritten.
        if held.issued:
            return
        held.issued = True
        with contextlib.suppress(ValueError):
            self._held_back.remove(held)
        if held.encoding is not None:
            held.encoding.cancel()  # what the thread makes is not needed; nothing waits for it
        held.settlement.set_result(CallbackFailed(texts.CALLBACK_REVOKED))

    async def _release_held_back(self) -> None:
        try:
            while self._held_back:
                head = self._held_back[0]
                if not head.ready:
                    assert head.encoding is not None
                    await asyncio.wait((head.encoding,))
                elif self._transport.backlogged():
                    await self._pump.drain()
                    # At least one per drain: a carrier whose drain() returns while it still
                    # counts as backlogged delays nothing, and never spins.
                    if self._held_back and self._held_back[0].ready:
                        self._issue_held_back(1)
                else:
                    self._issue_held_back(1)
        finally:
            self._releasing = None

    def _issue_held_back(self, count: int) -> None:
        for _ in range(min(count, len(self._held_back))):
            held = self._held_back.popleft()
            held.issued = True
            self._issue(held.start, held.settlement, held.cancellation)

    def _flush_callbacks(self) -> None:
        """The first callback of a loop iteration goes out at once; those that follow in the
        same iteration (a cell's ``Promise.all``) leave together at its end, in one write."""
        if self._batch_pending:
            return
        self.flush()
        self._batch_pending = True
        asyncio.get_running_loop().call_soon(self._flush_batch)

    def _flush_batch(self) -> None:
        self._batch_pending = False
        self.flush()

    def _revoke(self, delegate_id: int) -> None:
        self.protocol.revoke_callback(delegate_id)
        self.flush()
        # The client's task may still be running (its answer is suppressed): the callback
        # counts as finished after the runtime's grace, as a local delegate would.
        asyncio.get_running_loop().call_later(CALLBACK_GRACE, self._grace_over, delegate_id)

    def _grace_over(self, delegate_id: int) -> None:
        self.protocol.revocation_expired(delegate_id)
        self.flush()

    # -- the end -----------------------------------------------------------------------------------

    def _ended(self, event: ev.ConnectionEnded) -> None:
        if event.reason is not None:
            logger.warning("%s", event.reason)
        # Held-back callbacks end now, as those issued did (the machine answers them).
        if self._releasing is not None:
            self._releasing.cancel()
        self._issue_held_back(len(self._held_back))
        for request_id in event.requests:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
        # The reader may be waiting for a client that says nothing more: closing wakes it.
        if not self._closing:
            self._closing = True
            closing = asyncio.ensure_future(self._close_transport_soon())
            self._background.add(closing)
            closing.add_done_callback(self._background.discard)

    async def _close_transport_soon(self) -> None:
        # The frames written before the end (a rejection, the last answers) go out first.
        with contextlib.suppress(TransportError, OSError):
            await self._transport.drain()
        await self._close_transport()

    async def serve(self) -> bool:
        """Run until the connection ends, then clean up; True after a clean end."""
        await self.run()
        clean = await self.finish()
        return clean and self.protocol.failure is None

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


async def serve_v1_connection(
    transport: FrameTransport,
    provider: CodeModeSessionProvider,
    options: HostOptions | None = None,
    *,
    pair_bulk: Callable[[str], Awaitable[None]] | None = None,
) -> bool:
    """Serve one V1 connection until it ends; True after a clean end (EOF, cleanup done)."""
    served = V1HostConnection(
        transport, provider, (options or HostOptions()).protocol(), pair_bulk=pair_bulk
    )
    return await served.serve()
