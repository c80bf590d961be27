"""Remote sessions on a gRPC host (``grpc.md`` §4-§13): the client side of ``codex.code_mode.v1``.

:class:`GrpcCodeModeSessionProvider` shares one ``grpc.aio`` channel among its sessions. Each
:class:`GrpcSession` is bound to one gRPC session at a time (a lease from ``OpenSession`` and one
empty-filter tool subscription); delegate callbacks run through
:func:`~codemode.session.serve_callback` and are answered with ``CompleteToolCall`` /
``AcknowledgeNotification``. Losing the lease or the subscription, a host that breaks the
protocol, ``NOT_FOUND`` on a session rpc or a lost route fails the binding: every pending call
raises :class:`~codemode.errors.ConnectionClosed` with the reason, and the next ``execute`` or
``wait`` binds a new generation (§13.8).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

# Before grpc: the runtime forks engine processes (see codemode.host.grpc).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from grpc import aio

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    RemoteProtocolError,
    WireConversionError,
)
from codemode.grpc_stubs import v1_pb2_grpc
from codemode.protocol.arguments import (
    check_cell_id,
    check_execute_request,
    check_limits,
    check_wait_request,
)
from codemode.protocol.deadlines import DEFAULT_RESPONSE_TIMEOUT, observation_allowance
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    ToolReturned,
    tool_result_json,
)
from codemode.protocol.grpc import conversions, texts
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import MAX_IDENTIFIER_BYTES, MAX_MESSAGE_BYTES
from codemode.protocol.grpc.identifiers import (
    check_host_identifier,
    check_invocation_id,
    check_notification_id,
)
from codemode.protocol.options import checked_seconds
from codemode.protocol.texts import SESSION_SHUTTING_DOWN, TOO_MANY_CALLBACKS
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    LiveCell,
    MissingCell,
    Result,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
    Yielded,
)
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    StartedCell,
    cell_context,
    run_in,
    serve_callback,
)

__all__ = ["GrpcCodeModeSessionProvider", "GrpcSession", "parse_endpoint"]

logger = logging.getLogger("codemode.client")

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]

#: §5 an execute without ``yield_time_ms`` observes for this long.
DEFAULT_YIELD_TIME_MS: Final = 10_000
#: §11 tool invocations + notifications admitted and not finished, per session.
MAX_PENDING_CALLBACKS: Final = 1024
#: §6.4, §13.4 ids remembered per session.
REMEMBERED_IDS: Final = 4096
#: How long a terminal outcome waits for its cell's cancelled tool callbacks to settle.
CANCELLED_CALLBACK_GRACE: Final = 0.25
#: §13.2 admission attempts and the pauses between them.
ADMISSION_ATTEMPTS: Final = 5
ADMISSION_BACKOFF: Final = (0.1, 0.2, 0.4, 0.8)
#: §4.3 the routing token's metadata key.
ROUTE_KEY: Final = "x-code-mode-route"
#: §4.3 the marker of a router that lost the session.
ROUTE_LOST_KEY: Final = "x-code-mode-route-lost"
#: The metadata key of the bearer token (``grpc.md`` §1: shared with the WebSocket listener).
AUTHORIZATION_KEY: Final = "authorization"
#: How long a session's shutdown waits for the lease to end after ``CloseSession``.
LEASE_DRAIN_TIMEOUT: Final = 2.0
#: An ``UNAVAILABLE`` call waits this long for the lease to report a dead connection.
UNAVAILABLE_GRACE: Final = 0.5

_CHANNEL_OPTIONS: Final = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Pings only while a call is open: every session keeps its lease open, so a session is
    # always watched; a channel with no call has nothing to watch, and hosts refuse such pings
    # (grpc-core servers answer GOAWAY too_many_pings unless they permit them).
    ("grpc.keepalive_permit_without_calls", 0),
    # An idle lease carries no data for long: keep pinging it (grpc-core stops after 2).
    ("grpc.http2.max_pings_without_data", 0),
]
_RETRIED_ADMISSION: Final = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
#: §12.2 operations whose ``NOT_FOUND`` means the session is gone.
_SESSION_OPERATIONS: Final = frozenset(
    {"execution", "wait", "termination", "wait cancellation", "yield observation"}
)


def parse_endpoint(target: str) -> str:
    """The ``grpc.aio`` target of ``grpc://HOST:PORT``, ``http://HOST:PORT``, ``unix:/path`` or
    ``unix:///path`` (§13.1); raise :class:`CodeModeError` for anything else. Credentials in the
    URL are refused without repeating them."""
    if target.startswith("unix:"):
        if not target.removeprefix("unix:").lstrip("/"):
            raise CodeModeError(texts.invalid_endpoint("a unix endpoint needs a path"))
        return target
    try:
        parts = urlsplit(target)
        port = parts.port
    except ValueError:
        raise CodeModeError(texts.invalid_endpoint("the port must be 0-65535")) from None
    if "@" in parts.netloc:
        raise CodeModeError(texts.invalid_endpoint(texts.ENDPOINT_HAS_CREDENTIALS))
    if parts.scheme not in ("grpc", "http"):
        raise CodeModeError(
            texts.invalid_endpoint("expected grpc://HOST:PORT, http://HOST:PORT or unix:PATH")
        )
    if not parts.hostname or port is None:
        raise CodeModeError(texts.invalid_endpoint("a host and a port are required"))
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise CodeModeError(texts.invalid_endpoint("a gRPC endpoint has no path or query"))
    host = parts.hostname
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tool_key(name: str, namespace: str | None) -> tuple[str, str | None]:
    # §6.1: namespace `functions` is the same as no namespace.
    return (name, None if namespace in (None, "functions") else namespace)


def _status_text(error: aio.AioRpcError) -> tuple[str, str]:
    code = error.code()
    return code.name, error.details() or ""


def _route_lost(error: aio.AioRpcError) -> bool:
    """Whether a failed rpc's status metadata carries ``x-code-mode-route-lost: true`` (§4.3)."""
    for metadata in (error.initial_metadata(), error.trailing_metadata()):
        for key, value in metadata or ():
            if key == ROUTE_LOST_KEY and value == "true":
                return True
    return False


def _never_a_cell(wire_id: str) -> bool:
    """An id no host can give a cell (§3: non-empty, at most 256 bytes), which the host would
    refuse as malformed: it is a missing cell, as on every other carrier."""
    return not wire_id or len(wire_id.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER_BYTES


def _missing(cell_id: CellId) -> MissingCell:
    return MissingCell(Result(cell_id, [], _not_found(str(cell_id))))


def _not_found(cell_id: str) -> str:
    return f"exec cell {cell_id} not found"


def _observed(cell_id: str) -> str:
    return f"exec cell {cell_id} already has an active observer"


def _terminating(cell_id: str) -> str:
    return f"exec cell {cell_id} is already terminating"


#: The host's texts that name a cell (``runtime.md`` §13.9): the errors ``Wait`` and ``Terminate``
#: pass through (§12.2). After a reconnect they are rewritten to name the public id (§13.8).
_CELL_ERRORS: Final = (_observed, _terminating)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _keepalive_options(interval: float | None, timeout: float) -> list[tuple[str, int]]:
    """The channel's keepalive: a ping every ``interval`` seconds, whose ack may take
    ``timeout`` seconds before the connection, and every session on it, is given up."""
    if interval is None:
        return []
    return [
        ("grpc.keepalive_time_ms", _ms(interval)),
        ("grpc.keepalive_timeout_ms", _ms(timeout)),
        # What grpc-core (1.85) waits for a ping's ack is this one (default 60 s), as on the host.
        ("grpc.http2.ping_timeout_ms", _ms(timeout)),
    ]


def _quiet(task: asyncio.Future[Any]) -> None:
    task.add_done_callback(lambda done: done.cancelled() or done.exception())


class _Bounded:
    """The last ``REMEMBERED_IDS`` ids, oldest forgotten first."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, value: object) -> bool:
        return value in self._ids

    def add(self, value: str) -> None:
        self._ids[value] = None
        if len(self._ids) > REMEMBERED_IDS:
            self._ids.popitem(last=False)

    def discard(self, value: str) -> None:
        self._ids.pop(value, None)


@dataclass(eq=False, slots=True)
class _Execution:
    """What the client keeps per execution (§13.4)."""

    execution_id: str
    tool_call_id: str
    tools: dict[tuple[str, str | None], CodeModeToolKind]
    cell_id: str | None = None
    started: bool = False
    claimed: bool = False
    closed: bool = False
    released: bool = False
    abandoned: bool = False
    notifications: int = 0
    invocations: set[str] = field(default_factory=set)
    #: The execute's context: the cell's callbacks run in it (``session.cell_context``).
    context: contextvars.Context | None = None


@dataclass(eq=False, slots=True)
class _Callback:
    """An admitted tool invocation or notification whose delegate call has not finished."""

    record: _Execution
    token: CancellationToken
    cancelled: bool = False
    task: asyncio.Future[Any] | None = None


class _Binding:
    """One gRPC session of a :class:`GrpcSession` (§13.8): its lease, its subscription, its cells.

    Ids cross this boundary mapped to the binding's generation: wire ``42`` is public ``42`` in
    generation 1 and ``gN:42`` in generation N >= 2 (callers and the delegate see public ids).
    Once stopped, a binding never comes back; the :class:`GrpcSession` opens the next one.
    """

    def __init__(
        self,
        *,
        stub: Any,
        delegate: CodeModeSessionDelegate,
        session_id: str,
        lease: Any,
        route: str | None,
        generation: int,
        auth: Metadata = (),
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
    ) -> None:
        self._stub = stub
        self._response_timeout = response_timeout
        self._delegate = delegate
        self.session_id = session_id
        self.generation = generation
        self._prefix = "" if generation == 1 else f"g{generation}:"
        self._routed = route is not None
        self._lease = lease
        # Every call carries the bearer token (if any) and replays the route token (§4.3).
        metadata = auth if route is None else (*auth, (ROUTE_KEY, route))
        self._metadata: Metadata | None = metadata or None
        self._loop = asyncio.get_running_loop()
        self._subscription: Any = None
        self._stopped = False
        self._closing = False
        self._failure: str | None = None
        self._stopped_future: asyncio.Future[None] = self._loop.create_future()
        self._executions: dict[str, _Execution] = {}
        self._cells: dict[str, _Execution] = {}
        self._retired = _Bounded()
        self._invocations: dict[str, _Callback] = {}
        # Answered invocations whose CompleteToolCall is on its way (a cancellation may cross it).
        self._completing: dict[str, _Callback] = {}
        self._notifications: dict[str, _Callback] = {}
        self._seen_invocations = _Bounded()
        self._early_cancellations = _Bounded()
        # Early cancellations whose ToolCall has not arrived yet (id → when), and a wake-up for
        # outcomes waiting for them (see _finished).
        self._unmatched: dict[str, float] = {}
        self._matched = asyncio.Event()
        self._observing: set[str] = set()
        self._retiring: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Future[Any]] = set()
        self._readers: list[asyncio.Task[None]] = []
        self._shutdown: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def _start(self) -> None:
        request = pb.SubscribeToToolCallsRequest(session_id=self.session_id)
        self._subscription = self._stub.SubscribeToToolCalls(request, metadata=self._metadata)
        self._readers = [
            self._loop.create_task(self._read_lease(), name="codemode-grpc-lease"),
            self._loop.create_task(self._read_tool_calls(), name="codemode-grpc-tool-calls"),
        ]

    def is_alive(self) -> bool:
        """False once the binding failed or was shut down; it never comes back."""
        return not self._stopped and not self._closing

    def _public(self, wire_id: str) -> str:
        return self._prefix + wire_id

    def _wire(self, cell_id: CellId) -> str:
        """The host's id of a public cell id (§13.8), or the stale-generation error."""
        if not self._prefix:
            return cell_id.value
        if not cell_id.value.startswith(self._prefix):
            raise CodeModeError(texts.STALE_GENERATION)
        return cell_id.value[len(self._prefix) :]

    def _mapped(self, response: RuntimeResponse) -> RuntimeResponse:
        if not self._prefix:
            return response
        return dataclasses.replace(response, cell_id=CellId(self._public(response.cell_id.value)))

    def _mapped_missing(self, response: RuntimeResponse) -> RuntimeResponse:
        """A missing cell's outcome with public ids, its ``exec cell ⟨id⟩ not found`` included."""
        mapped = self._mapped(response)
        wire_id = response.cell_id.value
        if self._prefix and isinstance(mapped, Result) and mapped.error_text == _not_found(wire_id):
            mapped = dataclasses.replace(mapped, error_text=_not_found(self._public(wire_id)))
        return mapped

    def _mapped_error(self, error: CodeModeError, wire_id: str) -> CodeModeError:
        """A passed-through host error that names cell ``wire_id`` (only exactly one of the
        fixed texts, built from the id that was sent), naming its public id instead (§13.8)."""
        if self._prefix and type(error) is CodeModeError:
            for text in _CELL_ERRORS:
                if error.message == text(wire_id):
                    return CodeModeError(text(self._public(wire_id)))
        return error

    @property
    def failure(self) -> str | None:
        """Why the session failed, or ``None``."""
        return self._failure

    async def shutdown(self) -> None:
        """Close the session on the host (idempotent, shared by concurrent callers)."""
        if self._shutdown is None:
            self._closing = True  # from now on nothing new starts (§13.6)
            self._shutdown = self._loop.create_task(self._close())
        await asyncio.shield(self._shutdown)

    async def _close(self) -> None:
        self._closing = True
        if not self._stopped:
            request = pb.CloseSessionRequest(session_id=self.session_id)
            try:
                await self._race(
                    "session shutdown",
                    self._stub.CloseSession(request, metadata=self._metadata),
                    0.0,
                    closing=True,
                )
            except CodeModeError as error:
                logger.debug("CloseSession failed: %s", error)
            lease_reader = self._readers[0] if self._readers else None
            if lease_reader is not None:
                await asyncio.wait((lease_reader,), timeout=LEASE_DRAIN_TIMEOUT)
        self._stop(None)
        if self._readers:
            await asyncio.wait(self._readers, timeout=LEASE_DRAIN_TIMEOUT)

    def _fail(self, reason: str) -> None:
        """Record the first failure and stop the session (§13.7)."""
        if self._stopped:
            return
        logger.warning("gRPC code-mode session %s failed: %s", self.session_id, reason)
        self._stop(reason)

    def _stop(self, failure: str | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._failure = failure
        self._stopped_future.set_result(None)
        for callback in [*self._invocations.values(), *self._notifications.values()]:
            callback.cancelled = True
            callback.token.cancel()
        for call in (self._lease, self._subscription):
            if call is not None:
                call.cancel()
        for record in list(self._executions.values()):
            record.claimed = record.closed = True
            record.notifications = 0
            self._release(record)

    def _stopped_error(self) -> CodeModeError:
        if self._failure is not None:
            return ConnectionClosed(self._failure)
        if self._closing:
            return CodeModeError(SESSION_SHUTTING_DOWN)
        return ConnectionClosed(texts.GRPC_SESSION_IS_CLOSED)

    def _check_usable(self) -> None:
        if self._stopped or self._closing:
            raise self._stopped_error()

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        _quiet(future)

    # -- rpcs ----------------------------------------------------------------------------------

    async def _race(
        self, operation: str, awaitable: Awaitable[T], allowance: float, *, closing: bool = False
    ) -> T:
        """Await an rpc against the session's end and the §13.3 deadline (``response_timeout``
        past ``allowance``); map its status."""
        task: asyncio.Future[T] = asyncio.ensure_future(awaitable)
        try:
            async with asyncio.timeout(self._response_timeout + allowance):
                await asyncio.wait((task, self._stopped_future), return_when="FIRST_COMPLETED")
        except TimeoutError:
            task.cancel()
            _quiet(task)
            reason = texts.timed_out_waiting(operation)
            self._fail(reason)
            raise ConnectionClosed(reason) from None
        except asyncio.CancelledError:
            task.cancel()
            _quiet(task)
            raise
        if not task.done():
            task.cancel()
            _quiet(task)
            raise self._stopped_error()
        try:
            return task.result()
        except aio.AioRpcError as error:
            raise await self._status_error(operation, error) from None
        except asyncio.CancelledError:  # the rpc was cancelled under us: the session stopped
            raise self._stopped_error() from None

    async def _status_error(self, operation: str, error: aio.AioRpcError) -> CodeModeError:
        """§12.2: what a failed rpc means for its caller and the session."""
        code = error.code()
        name, message = _status_text(error)
        text = texts.operation_failed(operation, name, message)
        if self._routed and _route_lost(error):
            self._fail(text)  # §4.3: the router lost the session, like NOT_FOUND
            return ConnectionClosed(text)
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return CodeModeError(message)
        if code == grpc.StatusCode.NOT_FOUND and operation in _SESSION_OPERATIONS:
            self._fail(text)
            return ConnectionClosed(text)
        if self._stopped or (code == grpc.StatusCode.CANCELLED and self._closing):
            return self._stopped_error()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            # A dead or closing host: the lease says so at about the same time; prefer that.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._stopped_future), UNAVAILABLE_GRACE)
            if self._stopped:
                return self._stopped_error()
        return CodeModeError(text)

    # -- execute ----------------------------------------------------------------------------------

    async def execute(
        self, request: ExecuteRequest, *, early_yield: asyncio.Event | None = None
    ) -> StartedCell:
        """Admit a cell on the host; its first outcome is ``initial_response()``."""
        self._check_usable()
        if len(request.tool_call_id.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER_BYTES:
            raise CodeModeError(texts.host_returned_long_identifier("tool call ID"))
        execution_id = str(uuid.uuid4())
        try:
            proto = conversions.execute_request_to_proto(
                request, session_id=self.session_id, execution_id=execution_id
            )
        except WireConversionError as error:
            raise CodeModeError(error.message) from None
        tools = {
            _tool_key(tool.tool_name.name, tool.tool_name.namespace): CodeModeToolKind(tool.kind)
            for tool in request.enabled_tools
        }
        record = _Execution(execution_id, request.tool_call_id, tools, context=cell_context())
        self._executions[execution_id] = record  # before sending: callbacks may overtake started
        call = self._stub.Execute(proto, metadata=self._metadata)
        yielding = self._yield_early(early_yield, execution_id=execution_id)
        try:
            cell_id = await self._started(record, call)
        except asyncio.CancelledError:
            # Abandoned before admission: the host terminates an admitted cell; its CellClosed
            # releases the record (or, never admitted, nothing follows).
            if yielding is not None:
                yielding.cancel()
            call.cancel()
            record.claimed = True
            self._maybe_release(record)
            raise
        except BaseException:
            if yielding is not None:
                yielding.cancel()
            call.cancel()
            if record.cell_id is None:
                self._executions.pop(execution_id, None)
            else:
                record.claimed = True
                self._maybe_release(record)
            raise
        yield_ms = DEFAULT_YIELD_TIME_MS if request.yield_time_ms is None else request.yield_time_ms
        initial = self._initial(record, call, cell_id, observation_allowance(yield_ms), yielding)
        started = StartedCell.from_awaitable(
            CellId(self._public(cell_id)),
            initial,
            partial(self._abandon, record, call),
            yield_early=partial(self._yield_execution, record),
        )
        record.claimed = True
        self._maybe_release(record)
        return started

    async def _started(self, record: _Execution, call: Any) -> str:
        event = await self._race("execution", call.read(), 0.0)
        if event is aio.EOF:
            raise CodeModeError(texts.EXECUTION_ENDED_BEFORE_STARTING)
        if event.WhichOneof("event") != "started":
            raise CodeModeError(texts.EXECUTION_OMITTED_STARTING)
        started = event.started
        try:
            if started.execution_id != record.execution_id:
                raise RemoteProtocolError(
                    texts.execution_returned_id(started.execution_id, record.execution_id)
                )
            if record.started:
                raise RemoteProtocolError(texts.execution_started_twice(record.execution_id))
            self._bind(record, started.cell_id)
        except RemoteProtocolError as error:
            self._fail(error.message)
            raise ConnectionClosed(error.message) from None
        record.started = True
        return str(started.cell_id)

    async def _initial(
        self,
        record: _Execution,
        call: Any,
        cell_id: str,
        allowance: float,
        yielding: asyncio.Task[None] | None,
    ) -> RuntimeResponse:
        try:
            event = await self._race("execution", call.read(), allowance)
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            if yielding is not None:
                yielding.cancel()
        if event is aio.EOF:
            raise CodeModeError(texts.EXECUTION_OMITTED_INITIAL_OUTCOME)
        if event.WhichOneof("event") != "outcome":
            raise CodeModeError(texts.EXECUTION_UNEXPECTED_EVENT)
        response = self._decode(lambda: conversions.runtime_response_to_domain(event.outcome))
        if response.cell_id.value != cell_id:
            reason = texts.execution_returned_cell(response.cell_id.value, cell_id)
            self._fail(reason)
            raise ConnectionClosed(reason)
        await self._finished(record, response)
        return self._mapped(response)

    async def _finished(self, record: _Execution | None, response: RuntimeResponse) -> None:
        """A terminal outcome: the host no longer waits for the cell's tool calls, whose
        ``ToolCallCancelled`` may still be on its way on the lease (another stream). Cancel them
        here and give their delegates a moment to see it, so that, as on every other carrier,
        a cell's outcome follows the cancellation of its unfinished calls."""
        if record is None or isinstance(response, Yielded):
            return
        # A ToolCall may trail its own cancellation (another stream): let it arrive first.
        deadline = self._loop.time() + CANCELLED_CALLBACK_GRACE
        while self._unmatched and (remaining := deadline - self._loop.time()) > 0:
            stale = deadline - 4 * CANCELLED_CALLBACK_GRACE
            for invocation_id, seen in list(self._unmatched.items()):
                if seen < stale:
                    del self._unmatched[invocation_id]
            if not self._unmatched:
                break
            self._matched.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._matched.wait(), remaining)
        tasks = []
        for invocation_id in list(record.invocations):
            callback = self._invocations.get(invocation_id)
            if callback is not None:
                callback.cancelled = True
                callback.token.cancel()
                if callback.task is not None:
                    tasks.append(callback.task)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCELLED_CALLBACK_GRACE)

    def _abandon(self, record: _Execution, call: Any) -> None:
        """The caller dropped the started cell before its initial response (§5): its tool
        callbacks are cancelled at once, later ones are answered closed (§14.1), and the host is
        asked to terminate it."""
        record.abandoned = True
        call.cancel()
        for invocation_id in list(record.invocations):
            callback = self._invocations.get(invocation_id)
            if callback is not None:
                callback.cancelled = True
                callback.token.cancel()
        cell_id = record.cell_id
        if not self._stopped and not self._closing and cell_id is not None and not record.closed:
            request = pb.TerminateRequest(session_id=self.session_id, cell_id=cell_id)
            with contextlib.suppress(RuntimeError):  # from a finalizer after the loop closed
                self._keep(
                    asyncio.ensure_future(
                        self._race(
                            "termination",
                            self._stub.Terminate(request, metadata=self._metadata),
                            0.0,
                        ),
                        loop=self._loop,
                    )
                )

    def _decode(self, convert: Callable[[], T]) -> T:
        try:
            return convert()
        except RemoteProtocolError as error:
            self._fail(error.message)
            raise ConnectionClosed(error.message) from None
        except WireConversionError as error:
            raise CodeModeError(error.message) from None

    # -- wait / terminate -------------------------------------------------------------------------

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        """Observe a cell for up to ``request.yield_time_ms`` (one wait per cell at a time)."""
        key = self._wire(request.cell_id)
        self._check_usable()
        if _never_a_cell(key):
            return _missing(request.cell_id)
        if key in self._observing:
            raise CodeModeError(_observed(str(request.cell_id)))
        self._observing.add(key)
        try:
            retiring = self._retiring.get(key)
            if retiring is not None:
                await asyncio.shield(retiring)
                self._check_usable()
            wait_id = str(uuid.uuid4())
            try:
                proto = conversions.wait_request_to_proto(
                    dataclasses.replace(request, cell_id=CellId(key)),
                    session_id=self.session_id,
                    wait_id=wait_id,
                )
            except WireConversionError as error:
                raise CodeModeError(error.message) from None
            call = self._stub.Wait(proto, metadata=self._metadata)
            yielding = self._yield_early(early_yield, wait_id=wait_id)
            try:
                allowance = observation_allowance(request.yield_time_ms)
                response = await self._race("wait", call, allowance)
            except asyncio.CancelledError:
                self._retire_wait(key, wait_id)
                raise
            except CodeModeError as error:
                mapped = self._mapped_error(error, key)
                if mapped is error:
                    raise
                raise mapped from None
            finally:
                if yielding is not None:
                    yielding.cancel()
        finally:
            self._observing.discard(key)
        return await self._checked_outcome(response, key)

    async def _checked_outcome(self, response: pb.WaitResponse, cell_id: str) -> WaitOutcome:
        outcome = self._decode(lambda: conversions.wait_outcome_to_domain(response))
        got = outcome.response.cell_id.value
        if got != cell_id:
            reason = texts.host_returned_cell(got, cell_id)
            self._fail(reason)
            raise ConnectionClosed(reason)
        if isinstance(outcome, LiveCell):
            await self._finished(self._cells.get(cell_id), outcome.response)
            return LiveCell(self._mapped(outcome.response))
        return MissingCell(self._mapped_missing(outcome.response))

    def _yield_early(
        self, signal: asyncio.Event | None, **observation: str
    ) -> asyncio.Task[None] | None:
        """Send ``YieldObservation`` for ``observation`` once ``signal`` is set (§8.4)."""
        if signal is None:
            return None

        async def watch() -> None:
            await signal.wait()
            await self._yield_observation(**observation)

        task = self._loop.create_task(watch(), name="codemode-grpc-early-yield")
        _quiet(task)
        return task

    async def _yield_observation(self, **observation: str) -> None:
        request = pb.YieldObservationRequest(session_id=self.session_id, **observation)
        call = self._stub.YieldObservation(request, metadata=self._metadata)
        try:
            await self._race("yield observation", call, 0.0)
        except CodeModeError as error:
            logger.debug("YieldObservation failed: %s", error)

    def _yield_execution(self, record: _Execution) -> None:
        """``StartedCell.yield_early()``: end the Execute's initial observation (§8.4)."""
        if not self._stopped and not self._closing:
            coroutine = self._yield_observation(execution_id=record.execution_id)
            self._keep(asyncio.ensure_future(coroutine, loop=self._loop))

    def _retire_wait(self, key: str, wait_id: str) -> None:
        if self._stopped:
            return
        task = self._loop.create_task(self._cancel_wait(wait_id))
        self._retiring[key] = task

        def done(_: object) -> None:
            if self._retiring.get(key) is task:
                del self._retiring[key]

        task.add_done_callback(done)
        _quiet(task)

    async def _cancel_wait(self, wait_id: str) -> None:
        request = pb.CancelWaitRequest(session_id=self.session_id, wait_id=wait_id)
        try:
            await self._race(
                "wait cancellation", self._stub.CancelWait(request, metadata=self._metadata), 0.0
            )
        except ConnectionClosed:
            return
        except CodeModeError as error:
            if not self._stopped and not self._closing:
                self._fail(texts.wait_retire_failed(error.message))

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        """Stop a cell and return its final outcome."""
        wire_id = self._wire(cell_id)
        self._check_usable()
        if _never_a_cell(wire_id):
            return _missing(cell_id)
        request = pb.TerminateRequest(session_id=self.session_id, cell_id=wire_id)
        task = asyncio.ensure_future(
            self._race("termination", self._stub.Terminate(request, metadata=self._metadata), 0.0)
        )
        # Cancelled, the terminate goes on; its answer is discarded.
        self._keep(task)
        try:
            response = await asyncio.shield(task)
        except CodeModeError as error:
            mapped = self._mapped_error(error, wire_id)
            if mapped is error:
                raise
            raise mapped from None
        return await self._checked_outcome(response, wire_id)

    # -- cells ---------------------------------------------------------------------------------------

    def _bind(self, record: _Execution, cell_id: str) -> None:
        """Tie ``cell_id`` to ``record`` (from started, a callback or a closure; §13.4)."""
        check_host_identifier("cell ID", cell_id)
        if record.cell_id is None:
            owner = self._cells.get(cell_id)
            if owner is not None and owner is not record:
                raise RemoteProtocolError(texts.host_reused_cell(cell_id))
            record.cell_id = cell_id
            self._cells[cell_id] = record
        elif record.cell_id != cell_id:
            raise RemoteProtocolError(texts.execution_changed_cell(record.cell_id, cell_id))

    def _maybe_release(self, record: _Execution) -> None:
        # Its tool callbacks too have ended (CellClosed cancelled them), as on V1: the delegate
        # sees a callback's cancellation before the cell's ``cell_closed``, however close together
        # the host sent them.
        if (
            record.claimed
            and record.closed
            and record.notifications == 0
            and not record.invocations
        ):
            self._release(record)

    def _release(self, record: _Execution) -> None:
        if record.released:
            return
        record.released = True
        self._executions.pop(record.execution_id, None)
        self._retired.add(record.execution_id)
        cell_id = record.cell_id
        if cell_id is None:
            return
        if self._cells.get(cell_id) is record:
            del self._cells[cell_id]
        try:
            run_in(
                record.context, partial(self._delegate.cell_closed, CellId(self._public(cell_id)))
            )
        except Exception:
            logger.exception("cell_closed(%s) failed", cell_id)

    # -- the lease -----------------------------------------------------------------------------------

    async def _read_lease(self) -> None:
        lease = self._lease
        try:
            while True:
                event = await lease.read()
                if event is aio.EOF:
                    if not self._closing:
                        self._fail(texts.LEASE_CLOSED_UNEXPECTEDLY)
                    return
                self._on_session_event(event)
        except aio.AioRpcError as error:
            if not self._closing:
                self._fail(texts.operation_failed("session lease", *_status_text(error)))
        except RemoteProtocolError as error:
            self._fail(error.message)
        except asyncio.CancelledError:
            if not self._stopped:
                self._fail(texts.LEASE_CLOSED_UNEXPECTEDLY)
        except Exception as error:  # a bug here must not leave callers hanging
            logger.exception("the gRPC lease reader failed")
            self._fail(texts.operation_failed("session lease", "INTERNAL", str(error)))

    def _on_session_event(self, event: pb.SessionEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "tool_call_cancelled":
            self._on_tool_call_cancelled(event.tool_call_cancelled.invocation_id)
        elif kind == "notification":
            self._on_notification(event.notification)
        elif kind == "notification_cancelled":
            notification_id = check_notification_id(event.notification_cancelled.notification_id)
            callback = self._notifications.get(notification_id)
            if callback is not None:
                callback.token.cancel()
        elif kind == "cell_closed":
            self._on_cell_closed(event.cell_closed)
        elif kind == "opened":
            raise RemoteProtocolError(texts.LEASE_REPEATED_OPENING)
        else:
            raise RemoteProtocolError(texts.LEASE_EMPTY_EVENT)

    def _on_tool_call_cancelled(self, invocation_id: str) -> None:
        check_invocation_id(invocation_id)
        callback = self._invocations.get(invocation_id) or self._completing.get(invocation_id)
        if callback is not None:
            callback.cancelled = True
            callback.token.cancel()
        elif invocation_id not in self._seen_invocations:
            self._early_cancellations.add(invocation_id)
            self._unmatched[invocation_id] = self._loop.time()

    def _on_cell_closed(self, closed: pb.CellClosed) -> None:
        record = self._executions.get(closed.execution_id)
        if record is None:
            return  # retired, or never ours
        if record.closed:
            raise RemoteProtocolError(texts.invalid_closure(closed.cell_id))
        self._bind(record, closed.cell_id)
        record.closed = True
        for invocation_id in list(record.invocations):
            callback = self._invocations.get(invocation_id)
            if callback is not None:
                callback.cancelled = True
                callback.token.cancel()
        self._maybe_release(record)

    # -- notifications -------------------------------------------------------------------------------

    def _on_notification(self, notification: pb.Notification) -> None:
        notification_id = check_notification_id(notification.notification_id)
        record = self._executions.get(notification.execution_id)
        if record is None or record.closed:
            self._acknowledge(notification_id)
            return
        self._bind(record, notification.cell_id)
        call_id = check_host_identifier("notification call ID", notification.call_id)
        if call_id != record.tool_call_id:
            raise RemoteProtocolError(texts.NOTIFICATION_CALL_ID_MISMATCH)
        if self._pending() >= MAX_PENDING_CALLBACKS:
            logger.warning("notification %s dropped: %s", notification_id, TOO_MANY_CALLBACKS)
            self._acknowledge(notification_id)
            return
        token = CancellationToken()
        callback = _Callback(record, token)
        self._notifications[notification_id] = callback
        record.notifications += 1
        call = self._delegate.notify(
            call_id, CellId(self._public(record.cell_id or "")), notification.text, token
        )
        task = serve_callback(
            call,
            partial(self._notified, notification_id, callback),
            notification=True,
            context=record.context,
        )
        if task is not None:
            self._keep(task)

    def _notified(self, notification_id: str, callback: _Callback, result: CallbackResult) -> None:
        if self._notifications.get(notification_id) is callback:
            del self._notifications[notification_id]
        if isinstance(result, CallbackFailed):
            logger.warning(texts.notification_delegate_failed(result.message))
        record = callback.record
        if not record.released:
            record.notifications -= 1
            self._maybe_release(record)
        self._acknowledge(notification_id)

    def _acknowledge(self, notification_id: str) -> None:
        if self._stopped:
            return
        request = pb.AcknowledgeNotificationRequest(
            session_id=self.session_id, notification_id=notification_id
        )
        self._keep(asyncio.ensure_future(self._send_acknowledgement(request)))

    async def _send_acknowledgement(self, request: pb.AcknowledgeNotificationRequest) -> None:
        try:
            await self._stub.AcknowledgeNotification(request, metadata=self._metadata)
        except aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
                logger.debug("acknowledging notification failed: %s", error.details())

    # -- tool calls ----------------------------------------------------------------------------------

    def _pending(self) -> int:
        return len(self._invocations) + len(self._notifications)

    async def _read_tool_calls(self) -> None:
        subscription = self._subscription
        try:
            while True:
                call = await subscription.read()
                if call is aio.EOF:
                    if not self._closing:
                        self._fail(texts.SUBSCRIPTION_CLOSED_UNEXPECTEDLY)
                    return
                self._on_tool_call(call)
        except aio.AioRpcError as error:
            if not self._closing:
                self._fail(texts.operation_failed("tool subscription", *_status_text(error)))
        except RemoteProtocolError as error:
            self._fail(error.message)
        except asyncio.CancelledError:
            if not self._stopped:
                self._fail(texts.SUBSCRIPTION_CLOSED_UNEXPECTEDLY)
        except Exception as error:  # a bug here must not leave callers hanging
            logger.exception("the gRPC tool-call reader failed")
            self._fail(texts.operation_failed("tool subscription", "INTERNAL", str(error)))

    def _on_tool_call(self, call: pb.ToolCall) -> None:
        if call.session_id != self.session_id:
            raise RemoteProtocolError(
                texts.tool_call_wrong_session(call.session_id, self.session_id)
            )
        invocation_id = check_invocation_id(call.invocation_id)
        if invocation_id in self._seen_invocations or invocation_id in self._invocations:
            raise RemoteProtocolError(texts.INVOCATION_ID_REUSED)
        self._seen_invocations.add(invocation_id)
        early = invocation_id in self._early_cancellations
        if early:
            self._early_cancellations.discard(invocation_id)
            self._unmatched.pop(invocation_id, None)
            self._matched.set()
        record = self._executions.get(call.execution_id)
        if early:
            # Cancelled before it arrived (§6.4): never answered. The delegate still sees the
            # call, already cancelled, as it would on every other carrier (the contract suite).
            if record is None or record.released:  # its cell is gone: a detached record
                record = _Execution(call.execution_id, "", {}, call.cell_id, released=True)
            with contextlib.suppress(RemoteProtocolError, WireConversionError):
                self._bind(record, call.cell_id)
                self._admit(invocation_id, record, conversions.tool_call_to_domain(call), True)
            return
        if record is None or record.closed or record.released or record.abandoned:
            self._answer(invocation_id, CallbackFailed(texts.cell_is_closed(call.cell_id)))
            return
        self._bind(record, call.cell_id)
        try:
            invocation = conversions.tool_call_to_domain(call)
        except WireConversionError as error:
            self._answer(invocation_id, CallbackFailed(error.message))
            return
        name = invocation.tool_name
        if record.tools.get(_tool_key(name.name, name.namespace)) != invocation.tool_kind:
            self._answer(invocation_id, CallbackFailed(texts.tool_not_enabled(name.name)))
            return
        if self._pending() >= MAX_PENDING_CALLBACKS:
            self._answer(invocation_id, CallbackFailed(TOO_MANY_CALLBACKS))
            return
        self._admit(invocation_id, record, invocation, record.closed)

    def _admit(
        self,
        invocation_id: str,
        record: _Execution,
        invocation: CodeModeNestedToolCall,
        cancelled: bool,
    ) -> None:
        token = CancellationToken()
        callback = _Callback(record, token, cancelled)
        if cancelled:
            token.cancel()
        self._invocations[invocation_id] = callback
        record.invocations.add(invocation_id)
        if self._prefix:
            invocation = dataclasses.replace(
                invocation, cell_id=CellId(self._public(invocation.cell_id.value))
            )
        task = serve_callback(
            self._delegate.invoke_tool(invocation, token),
            partial(self._invoked, invocation_id, callback),
            context=record.context,
        )
        if task is not None:
            callback.task = task
            self._keep(task)

    def _invoked(self, invocation_id: str, callback: _Callback, result: CallbackResult) -> None:
        if self._invocations.get(invocation_id) is callback:
            del self._invocations[invocation_id]
        callback.record.invocations.discard(invocation_id)
        self._maybe_release(callback.record)
        if callback.cancelled or self._stopped:
            return  # §6.4: a cancelled invocation is never completed
        if isinstance(result, ToolReturned | CallbackFailed):
            self._answer(invocation_id, result, callback)

    def _answer(
        self,
        invocation_id: str,
        result: ToolReturned | CallbackFailed,
        callback: _Callback | None = None,
    ) -> None:
        if self._stopped:
            return
        if isinstance(result, ToolReturned):
            # The D5 text every carrier gives a value that is not JSON (the contract suite's).
            try:
                output = tool_result_json(result.value)
            except CodeModeError as error:
                result = CallbackFailed(error.message)
            else:
                request = conversions.fit_message_limit(
                    conversions.tool_call_succeeded(self.session_id, invocation_id, output)
                )
                self._keep(asyncio.ensure_future(self._complete(request, callback)))
                return
        request = conversions.complete_tool_call_request(self.session_id, invocation_id, result)
        self._keep(asyncio.ensure_future(self._complete(request, callback)))

    async def _complete(
        self, request: pb.CompleteToolCallRequest, callback: _Callback | None
    ) -> None:
        invocation_id = request.invocation_id
        if callback is not None:
            self._completing[invocation_id] = callback
        try:
            await self._race(
                "tool invocation completion",
                self._stub.CompleteToolCall(request, metadata=self._metadata),
                0.0,
            )
        except ConnectionClosed:
            return
        except CodeModeError as error:
            if callback is not None and callback.cancelled:
                return  # NOT_FOUND then means "cancelled meanwhile" (§6.3)
            if callback is None and self._closing:
                return
            self._fail(error.message)
        finally:
            self._completing.pop(invocation_id, None)

    def __repr__(self) -> str:
        return f"<gRPC binding {self.session_id!r}, generation {self.generation}>"


class GrpcSession(CodeModeSession):
    """A :class:`~codemode.session.CodeModeSession` served by a gRPC host, reconnecting (§13.8).

    It wraps a binding to one gRPC session (its lease) of generation 1, 2, 3, ... When that session
    is lost (the host restarted, the router lost it, ``NOT_FOUND``), the next :meth:`execute` or
    :meth:`wait` opens a new one. Calls created before the reconnect fail with
    :data:`~codemode.protocol.grpc.texts.RUNTIME_REPLACED` (stored values and running cells are
    gone; nothing is re-sent); calls created after run on the new generation, whose cell ids are
    ``g2:1``, ``g2:2``, ... Ids of an older generation are refused.

    ``early_yield`` (an :class:`asyncio.Event`) on :meth:`execute` and :meth:`wait` ends that
    observation early once set, without stopping the cell (``YieldObservation``, §8.4).
    """

    def __init__(
        self,
        provider: GrpcCodeModeSessionProvider,
        delegate: CodeModeSessionDelegate,
        request: pb.OpenSessionRequest,
        binding: _Binding,
    ) -> None:
        self._provider = provider
        self._delegate = delegate
        self._request = request
        self._binding: _Binding | None = binding
        self._last_generation = binding.generation
        self._loop = asyncio.get_running_loop()
        self._opening: asyncio.Task[_Binding] | None = None
        self._closing = False
        self._shutdown: asyncio.Task[None] | None = None

    @property
    def session_id(self) -> str:
        """The id of the current gRPC session ("" between a failed reopen and the next)."""
        return "" if self._binding is None else self._binding.session_id

    @property
    def generation(self) -> int:
        """The current binding's generation (1 until the first reconnect; 0 with none)."""
        return 0 if self._binding is None else self._binding.generation

    @property
    def failure(self) -> str | None:
        """Why the current binding failed, or ``None``."""
        return None if self._binding is None else self._binding.failure

    def is_alive(self) -> bool:
        """False once shut down, and while the current binding is lost (the next execute or
        wait reconnects)."""
        return not self._closing and self._binding is not None and self._binding.is_alive()

    def execute(  # not ``async def``: the generation is captured when the call is created
        self, request: ExecuteRequest, *, early_yield: asyncio.Event | None = None
    ) -> Coroutine[Any, Any, StartedCell]:
        """Admit a cell; its first outcome is ``initial_response()``."""
        return self._execute(request, self.generation, early_yield)

    async def _execute(
        self, request: ExecuteRequest, generation: int, early_yield: asyncio.Event | None
    ) -> StartedCell:
        check_execute_request(request)
        binding = await self._bound(generation)
        return await binding.execute(request, early_yield=early_yield)

    def wait(  # not ``async def``: the generation is captured when the call is created
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> Coroutine[Any, Any, WaitOutcome]:
        """Observe a cell for up to ``request.yield_time_ms`` (one wait per cell at a time)."""
        return self._wait(request, self.generation, early_yield)

    async def _wait(
        self, request: WaitRequest, generation: int, early_yield: asyncio.Event | None
    ) -> WaitOutcome:
        check_wait_request(request)
        binding = await self._bound(generation)
        return await binding.wait(request, early_yield=early_yield)

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        """Stop a cell and return its final outcome (never reconnects)."""
        check_cell_id(cell_id)
        binding = self._binding
        if self._closing or binding is None:
            raise CodeModeError(SESSION_SHUTTING_DOWN)
        return await binding.terminate(cell_id)

    async def _bound(self, generation: int) -> _Binding:
        """The binding a call created in ``generation`` runs on; reconnects a lost one (§13.8)."""
        if self._closing:
            raise CodeModeError(SESSION_SHUTTING_DOWN)
        binding = self._binding
        if binding is None or not binding.is_alive():
            if self._opening is None:
                self._opening = self._loop.create_task(self._reopen(), name="codemode-grpc-reopen")
                _quiet(self._opening)
            opening = self._opening
            try:
                binding = await asyncio.shield(opening)
            except asyncio.CancelledError:
                if opening.cancelled() and self._closing:
                    raise CodeModeError(SESSION_SHUTTING_DOWN) from None
                raise
        if binding.generation != generation:
            raise CodeModeError(texts.RUNTIME_REPLACED)
        return binding

    async def _reopen(self) -> _Binding:
        old = self._binding
        try:
            if old is not None:
                self._binding = None
                await old.shutdown()
            generation = self._last_generation + 1
            binding = await self._provider._open_binding(self._request, self._delegate, generation)
            logger.info(
                "gRPC code-mode session reconnected: generation %d, session %s",
                generation,
                binding.session_id,
            )
            self._binding = binding
            self._last_generation = generation
            return binding
        finally:
            self._opening = None

    async def shutdown(self) -> None:
        """Close the session on the host (idempotent, shared by concurrent callers)."""
        if self._shutdown is None:
            self._closing = True  # from now on nothing new starts (§13.6)
            if self._opening is not None:
                self._opening.cancel()
            self._shutdown = self._loop.create_task(self._close())
        await asyncio.shield(self._shutdown)

    async def _close(self) -> None:
        opening = self._opening
        if opening is not None:
            await asyncio.wait((opening,))
        if self._binding is not None:
            await self._binding.shutdown()
        self._provider._forget(self)

    def __del__(self) -> None:
        # Dropped without shutdown() (§13.6): shut the binding down on the session's loop.
        binding = self._binding
        if self._closing or binding is None or not binding.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to tell
            self._loop.call_soon_threadsafe(self._provider._shut_down_dropped, binding)

    def __repr__(self) -> str:
        return f"GrpcSession({self.session_id!r}, generation={self.generation})"


class GrpcCodeModeSessionProvider(CodeModeSessionProvider):
    """Creates :class:`GrpcSession` objects on one shared ``grpc.aio`` channel (§13.1).

    ``target`` is ``grpc://HOST:PORT``, ``http://HOST:PORT``, ``unix:/path`` or ``unix:///path``.
    ``token``: sent as ``authorization: Bearer <token>`` metadata on every call. ``tls``: connect
    over TLS (the URL keeps its ``grpc://`` scheme), verifying the host against
    ``root_certificates`` (PEM bytes; giving them implies ``tls``) or the system's roots.

    Every ``ping_interval`` seconds while sessions are open the channel pings the host; an ack
    that takes longer than ``ping_timeout`` ends the connection and fails every session on it,
    idle or busy (``ping_interval=None``: no pings). The host must permit the pings: ``codemode
    host`` takes one every 10 s at most, more often it ends the connection (``too_many_pings``).
    A call unanswered for ``response_timeout`` seconds (default 60) past its runtime allowance
    fails its session (§13.3); ``open_timeout`` bounds opening a session (default:
    ``response_timeout``).
    """

    def __init__(
        self,
        target: str,
        *,
        open_timeout: float | None = None,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
        ping_interval: float | None = 20.0,
        ping_timeout: float = 20.0,
    ) -> None:
        if token is not None and (not token or any(c in token for c in "\r\n")):
            raise CodeModeError("the bearer token is empty or spans lines")
        self.response_timeout = checked_seconds("response_timeout", response_timeout)
        self._open_timeout = (
            self.response_timeout
            if open_timeout is None
            else checked_seconds("open_timeout", open_timeout)
        )
        self._keepalive = _keepalive_options(
            None if ping_interval is None else checked_seconds("ping_interval", ping_interval),
            checked_seconds("ping_timeout", ping_timeout),
        )
        self.target = target
        self._address = parse_endpoint(target)
        self._auth: Metadata = () if token is None else ((AUTHORIZATION_KEY, f"Bearer {token}"),)
        self._tls = tls or root_certificates is not None
        self._root_certificates = root_certificates
        self._channel: aio.Channel | None = None
        self._stub: Any = None
        # Weak: a session dropped without shutdown() shuts itself down (§13.6).
        self._sessions: weakref.WeakSet[GrpcSession] = weakref.WeakSet()
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False

    def _connect(self) -> Any:
        if self._closed:
            raise CodeModeError("code-mode session provider is closed")
        if self._channel is None:
            options: list[tuple[str, str | int]] = [*_CHANNEL_OPTIONS, *self._keepalive]
            if self._address.startswith("unix:"):
                # grpc would send the socket path, percent-encoded, as :authority; some servers
                # (upstream's, on hyper) reset such a stream.
                options.append(("grpc.default_authority", "localhost"))
            if self._tls:
                credentials = grpc.ssl_channel_credentials(self._root_certificates)
                self._channel = aio.secure_channel(self._address, credentials, options=options)
            else:
                self._channel = aio.insecure_channel(self._address, options=options)
            self._stub = v1_pb2_grpc.CodeModeHostStub(self._channel)
        return self._stub

    async def create_session(self, delegate: CodeModeSessionDelegate) -> GrpcSession:
        """Open a session served by ``delegate``."""
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits,
    ) -> GrpcSession:
        """Open a session whose cells share ``limits`` (admission retried as in §13.2)."""
        check_limits(limits)
        try:
            request = conversions.open_session_request(limits)
        except WireConversionError as error:
            raise CodeModeError(error.message) from None
        binding = await self._open_binding(request, delegate, 1)
        session = GrpcSession(self, delegate, request, binding)
        self._sessions.add(session)
        return session

    async def _open_binding(
        self, request: pb.OpenSessionRequest, delegate: CodeModeSessionDelegate, generation: int
    ) -> _Binding:
        """Admit one gRPC session: ``OpenSession``, ``SessionOpened``, the subscription (§13.2)."""
        stub = self._connect()
        for attempt in range(ADMISSION_ATTEMPTS):
            try:
                return await self._open(stub, request, delegate, generation)
            except aio.AioRpcError as error:
                if error.code() in _RETRIED_ADMISSION and attempt + 1 < ADMISSION_ATTEMPTS:
                    await asyncio.sleep(ADMISSION_BACKOFF[attempt])
                    continue
                raise CodeModeError(
                    texts.operation_failed("session opening", *_status_text(error))
                ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _open(
        self,
        stub: Any,
        request: pb.OpenSessionRequest,
        delegate: CodeModeSessionDelegate,
        generation: int,
    ) -> _Binding:
        lease = stub.OpenSession(request, metadata=self._auth or None)
        try:
            async with asyncio.timeout(self._open_timeout):
                first = await lease.read()
                route = None
                if first is not aio.EOF:
                    metadata = await lease.initial_metadata()
                    route = None if metadata is None else metadata.get(ROUTE_KEY)
        except TimeoutError:
            lease.cancel()
            raise CodeModeError(texts.timed_out_waiting("session opening")) from None
        except BaseException:
            lease.cancel()
            raise
        try:
            if first is aio.EOF:
                raise CodeModeError(texts.LEASE_ENDED_BEFORE_OPENING)
            if first.WhichOneof("event") != "opened":
                raise CodeModeError(texts.LEASE_OMITTED_OPENING)
            session_id = check_host_identifier("session ID", first.opened.session_id)
        except CodeModeError:
            lease.cancel()
            raise
        binding = _Binding(
            stub=stub,
            delegate=delegate,
            session_id=session_id,
            lease=lease,
            route=None if route is None else str(route),
            generation=generation,
            auth=self._auth,
            response_timeout=self.response_timeout,
        )
        binding._start()
        return binding

    def _forget(self, session: GrpcSession) -> None:
        self._sessions.discard(session)

    def _shut_down_dropped(self, binding: _Binding) -> None:
        task = asyncio.ensure_future(binding.shutdown())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        _quiet(task)

    async def aclose(self) -> None:
        """Shut down every session, then close the channel."""
        self._closed = True
        sessions, self._sessions = list(self._sessions), weakref.WeakSet()
        await asyncio.gather(*(session.shutdown() for session in sessions), return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=LEASE_DRAIN_TIMEOUT)
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> GrpcCodeModeSessionProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
