"""Serve the code-mode session API over gRPC (``grpc.md``): ``codex.code_mode.v1.CodeModeHost``.

:class:`GrpcHost` is a ``grpc.aio`` server in front of a
:class:`~codemode.session.CodeModeSessionProvider` (normally the embedded runtime). Each
``OpenSession`` stream is a session's lease; each session gets a :class:`_HostDelegate` that turns
the runtime's nested tool calls and notifications into ``ToolCall``\\ s on the session's
subscriptions and ``Notification`` events on its lease, answered by ``CompleteToolCall`` /
``AcknowledgeNotification``. Cancellation tokens of the runtime revoke them
(``ToolCallCancelled`` / ``NotificationCancelled``). ``YieldObservation{execution_id}`` ends an
``Execute``'s initial observation through :meth:`~codemode.session.StartedCell.yield_early`
(``UNIMPLEMENTED`` where the session cannot); ``YieldObservation{wait_id}`` detaches the ``Wait``'s
observer, whose items stay buffered for the next observation. Statuses follow ``grpc.md`` §12.1.

:func:`serve_grpc` runs a host until a stop event is set (the ``--listen grpc://`` command line).

Authentication and TLS follow the WebSocket listener (``grpc.md`` §1): with a token, every
``CodeModeHost`` rpc must carry the metadata ``authorization: Bearer <token>`` (the scheme in any
case) or it ends ``UNAUTHENTICATED`` (checked by :class:`_BearerTokenInterceptor`, the token in
constant time); the ``grpc.health.v1.Health`` service stays open, as ``GET /readyz`` does on the
WebSocket listener. With :class:`GrpcTls` the port serves TLS (``grpc.ssl_server_credentials``);
the URL stays ``grpc://`` (TLS is a property of the channel, not of the address).
"""

# ruff: noqa: E402 - grpc must be imported after GRPC_ENABLE_FORK_SUPPORT is set (below)
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, NoReturn, TypeVar, cast

# The runtime forks engine processes (with a pre-exec hook); gRPC's fork handlers make such
# children crash while gRPC threads run. Off unless the environment says otherwise; it only
# takes effect when this module is imported before ``grpc``.
_GRPC_IMPORTED_FIRST: Final = "grpc" in sys.modules
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from codemode.errors import CodeModeError, EngineLimitError, WireConversionError
from codemode.grpc_stubs import v1_pb2_grpc
from codemode.host.address import MIN_CLIENT_PING_INTERVAL, bracketed, split_listen_url
from codemode.host.auth import bearer_token_matches
from codemode.protocol import pieces, strict_json
from codemode.protocol.constants import (
    CALLBACK_GRACE,
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    MAX_PENDING_DELEGATE_CALLS,
    SHUTDOWN_TIMEOUT,
)
from codemode.protocol.grpc import conversions, texts
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import (
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    SERVICE_PATH_PREFIX,
)
from codemode.protocol.grpc.identifiers import canonical_uuid, check_request_identifier
from codemode.protocol.options import checked_count, checked_seconds
from codemode.protocol.texts import (
    PROVIDER_DOES_NOT_SUPPORT_LIMITS,
    SESSION_SHUTTING_DOWN,
    TOO_MANY_CALLBACKS,
)
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    WaitOutcome,
)
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    StartedCell,
)

__all__ = ["GrpcAddress", "GrpcHost", "GrpcHostOptions", "GrpcTls", "serve_grpc"]

logger = logging.getLogger("codemode.host")
_T = TypeVar("_T")

Context = aio.ServicerContext[Any, Any]

#: Ids remembered per session for reuse detection, cancelled waits and early yields (§3, §11).
REMEMBERED_IDS: Final = 4096
#: Tool-call subscriptions one session may hold open at once. A client opens one (or one per tool
#: filter); each costs the host some 25 KiB, and they were unbounded: 5,000 of one session took
#: 250 MiB.
MAX_SUBSCRIPTIONS_PER_SESSION: Final = 64
#: Tool names a session's open subscriptions may list together (their filters). A name costs the
#: host some 100-700 bytes as a key of a filter, and they were unbounded: a subscription of 64 MiB
#: of short names (7 million) held the event loop 6 s while its filter was built and took 1.7 GiB,
#: and a session may hold 64 of them.
MAX_SUBSCRIBED_TOOL_NAMES: Final = 4096
#: Seconds between the host's HTTP/2 keepalive pings on a connection, and how long a ping's ack
#: may take before the connection ends (with every session whose lease it carried).
DEFAULT_KEEPALIVE_TIME: Final = 20.0
DEFAULT_KEEPALIVE_TIMEOUT: Final = 20.0


@dataclass(frozen=True, slots=True)
class GrpcHostOptions:
    """Admission limits (``--max-active-cells``, ``--max-in-flight-requests``; ``max_sessions``,
    ``None`` for no bound: past it ``OpenSession`` ends ``RESOURCE_EXHAUSTED``), the bound of
    ``CloseSession`` (§4.1) and the server's HTTP/2 keepalive (seconds; a ``keepalive_time`` of 0
    sends no pings). A client may ping once every ``min_client_ping_interval`` seconds while it
    sends nothing else (more often: GOAWAY ``too_many_pings``)."""

    max_active_cells: int = DEFAULT_MAX_ACTIVE_CELLS
    max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS
    session_shutdown_timeout: float = SHUTDOWN_TIMEOUT
    max_sessions: int | None = None
    keepalive_time: float = DEFAULT_KEEPALIVE_TIME
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    min_client_ping_interval: float = MIN_CLIENT_PING_INTERVAL

    def __post_init__(self) -> None:
        checked_count("max_active_cells", self.max_active_cells)
        checked_count("max_in_flight_requests", self.max_in_flight_requests)
        checked_seconds("session_shutdown_timeout", self.session_shutdown_timeout, zero=True)
        if self.max_sessions is not None:
            checked_count("max_sessions", self.max_sessions)
        checked_seconds("keepalive_time", self.keepalive_time, zero=True)
        checked_seconds("keepalive_timeout", self.keepalive_timeout)
        checked_seconds("min_client_ping_interval", self.min_client_ping_interval, zero=True)

    def server_options(self) -> list[tuple[str, int]]:
        """The ``grpc.aio.server`` channel arguments: 64 MiB messages and the keepalive."""
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            (
                "grpc.http2.min_recv_ping_interval_without_data_ms",
                _ms(self.min_client_ping_interval),
            ),
        ]
        if self.keepalive_time > 0:
            options += [
                ("grpc.keepalive_time_ms", _ms(self.keepalive_time)),
                ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout)),
                # What grpc-core (1.85) waits for a ping's ack is this one (default 60 s); with
                # only keepalive_timeout set, a silent client kept its sessions for a minute more.
                ("grpc.http2.ping_timeout_ms", _ms(self.keepalive_timeout)),
                # An idle lease carries no data for long: keep pinging it all the same.
                ("grpc.http2.max_pings_without_data", 0),
            ]
        return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True, slots=True)
class GrpcAddress:
    """Where to listen: ``grpc://ADDR:PORT`` (``PORT`` 0 picks a free port)."""

    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> GrpcAddress:
        """Parse a listen URL; raise :class:`ValueError` saying what is wrong with it."""
        parts, host, port = split_listen_url(url, "grpc", "grpc://ADDR:PORT")
        if parts.path not in ("", "/"):
            raise ValueError(f"{url}: a gRPC listen URL has no path")
        return cls(host, port)

    def bind_target(self) -> str:
        return f"{bracketed(self.host)}:{self.port}"

    def url(self, port: int | None = None) -> str:
        return f"grpc://{bracketed(self.host)}:{self.port if port is None else port}"


@dataclass(frozen=True, slots=True)
class GrpcTls:
    """The host's TLS identity: a PEM certificate chain and its PEM private key."""

    certificate_chain: bytes
    private_key: bytes

    @classmethod
    def from_files(
        cls, certificate: str | os.PathLike[str], key: str | os.PathLike[str]
    ) -> GrpcTls:
        """Read ``--tls-cert`` / ``--tls-key``; raise :class:`ValueError` for an empty file (and
        :class:`OSError` when one cannot be read)."""
        chain = Path(certificate).read_bytes()
        private_key = Path(key).read_bytes()
        for path, content in ((certificate, chain), (key, private_key)):
            if not content.strip():
                raise ValueError(f"{os.fspath(path)} is empty")
        return cls(chain, private_key)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)])


#: The metadata key of the bearer token (gRPC metadata keys are lower case).
AUTHORIZATION_KEY: Final = "authorization"
#: What a call without the right token ends with (``UNAUTHENTICATED``).
UNAUTHENTICATED_MESSAGE: Final = (
    "a bearer token is required: send metadata `authorization: Bearer <token>`"
)
#: Services served without a token (the health service, like ``GET /readyz``).
_OPEN_SERVICE_PREFIXES: Final = ("/grpc.health.v1.Health/",)


async def _deny(request: object, context: Context) -> NoReturn:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    raise AssertionError("unreachable")  # pragma: no cover - abort raises


class _BearerTokenInterceptor(aio.ServerInterceptor):
    """Ends every rpc (but the health service's) without ``authorization: Bearer <token>`` with
    ``UNAUTHENTICATED``; the comparison takes the same time wherever the tokens differ."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == AUTHORIZATION_KEY:
                given = value if isinstance(value, bytes) else str(value).encode()
                break
        return bearer_token_matches(given, self._token)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method or ""
        if method.startswith(_OPEN_SERVICE_PREFIXES) or self._authorized(handler_call_details):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNAUTHENTICATED all the same (nothing leaks)
            return grpc.unary_unary_rpc_method_handler(_deny)
        deserializer = handler.request_deserializer
        serializer = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny, deserializer, serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny, deserializer, serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny, deserializer, serializer)
        return grpc.unary_unary_rpc_method_handler(_deny, deserializer, serializer)


def undecodable_request(detail: str) -> str:
    """What a request that is not a valid protobuf message ends with (``INTERNAL``, as the
    reference host's tonic and grpc-go answer it): the parser's text, not a Python exception."""
    return f"failed to decode Protobuf message: {detail}"


class _Undecodable:
    """A request that failed to parse (its call then ends ``INTERNAL``)."""

    __slots__ = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            return _Undecodable(str(error))

    return deserialize


async def _refuse(request: _Undecodable, context: Context, method: str) -> NoReturn:
    logger.debug("event=undecodable-request method=%s detail=%s", method, request.detail)
    await context.abort(grpc.StatusCode.INTERNAL, undecodable_request(request.detail))
    raise AssertionError("unreachable")  # pragma: no cover - abort raises


class _RequestDecodingInterceptor(aio.ServerInterceptor):
    """Ends a ``CodeModeHost`` call whose request bytes do not parse with ``INTERNAL`` and the
    parser's text. (grpcio would end it ``UNKNOWN``, naming the Python exception, and log an error
    with a traceback for every such request: a peer could fill the host's log.)"""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if (
            handler is None
            or handler.request_streaming
            or not method.startswith(SERVICE_PATH_PREFIX)
        ):
            return handler
        deserializer = _tolerant(handler.request_deserializer)
        serializer = handler.response_serializer
        if handler.response_streaming:
            # The servicer's own (asynchronous) methods: this interceptor sees no others.
            stream = cast(Callable[[Any, Context], AsyncGenerator[Any]], handler.unary_stream)

            async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await _refuse(request, context, method)
                async with contextlib.aclosing(stream(request, context)) as events:
                    async for event in events:
                        yield event

            return grpc.unary_stream_rpc_method_handler(streaming, deserializer, serializer)
        unary = cast(Callable[[Any, Context], Awaitable[Any]], handler.unary_unary)

        async def answering(request: Any, context: Context) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(request, context, method)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(answering, deserializer, serializer)


class _Remembered:
    """A bounded set of ids (the oldest are forgotten first)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, value: str) -> bool:
        return value in self._ids

    def add(self, value: str) -> None:
        self._ids[value] = None
        self._ids.move_to_end(value)
        while len(self._ids) > REMEMBERED_IDS:
            self._ids.popitem(last=False)

    def discard(self, value: str) -> None:
        self._ids.pop(value, None)


class _Outbox(Generic[_T]):
    """What one stream of a session will write, in order. An entry withdrawn before its turn
    is never written, and nothing of it stays: a client that does not read a stream keeps
    only what is still wanted, however many cells give their callbacks up meanwhile."""

    __slots__ = ("_ended", "_entries", "_keys", "_ready")

    def __init__(self) -> None:
        self._entries: OrderedDict[object, _T] = OrderedDict()
        self._keys = itertools.count()
        self._ready = asyncio.Event()
        self._ended = False

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: _T, key: object = None) -> None:
        """Queue ``entry``; ``key`` names it for :meth:`withdraw`."""
        if not self._ended:
            self._entries[next(self._keys) if key is None else key] = entry
            self._ready.set()

    def withdraw(self, key: object) -> bool:
        """Take the entry ``key`` back; false when it is not waiting (written, or never put)."""
        return self._entries.pop(key, None) is not None

    def take_all(self) -> list[_T]:
        """Everything still waiting, in order, taken out."""
        entries = list(self._entries.values())
        self._entries.clear()
        return entries

    def end(self) -> None:
        """No more entries: :meth:`get` returns ``None`` once those waiting were taken."""
        self._ended = True
        self._ready.set()

    async def get(self) -> _T | None:
        """The next entry, or ``None`` at the end."""
        while not self._entries:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._entries.popitem(last=False)[1]


class _Status(Exception):
    """An RPC ends with this status (raised inside, turned into ``context.abort``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False, slots=True)
class _Execution:
    execution_id: str
    cell_id: CellId | None = None
    sequence: int = 0
    holds_slot: bool = False
    closed: bool = False
    #: The admitted cell while its initial observation runs (YieldObservation ends it early).
    started: StartedCell | None = None
    #: A YieldObservation came before the cell was admitted: applied at admission.
    yield_requested: bool = False


@dataclass(eq=False, slots=True)
class _Invocation:
    invocation_id: str
    message: pb.ToolCall
    name: tuple[str, str | None]
    future: asyncio.Future[JSON]
    #: The subscription it was routed to (``None`` while no subscription matches it).
    routed: _Subscription | None = None


@dataclass(eq=False, slots=True)
class _Subscription:
    names: frozenset[tuple[str, str | None]]
    queue: _Outbox[_Invocation] = field(default_factory=_Outbox)

    def matches(self, name: tuple[str, str | None]) -> bool:
        return not self.names or name in self.names


@dataclass(eq=False, slots=True)
class _Wait:
    task: asyncio.Task[WaitOutcome]
    cell_id: CellId
    early_yield: asyncio.Event
    cancelled: bool = False


def _tool_key(name: str, namespace: str | None) -> tuple[str, str | None]:
    # Namespace `functions` is the same as no namespace (§6.1).
    return (name, None if namespace in (None, "", "functions") else namespace)


class _Session:
    """One gRPC session: the runtime session and everything that correlates its messages."""

    def __init__(self, host: GrpcHost, session_id: str) -> None:
        self.host = host
        self.session_id = session_id
        self.runtime: CodeModeSession | None = None
        self.lease: _Outbox[pb.SessionEvent] = _Outbox()
        self.closing = False
        self.closed = asyncio.Event()
        self.close_task: asyncio.Task[None] | None = None
        self.execution_ids = _Remembered()
        self.executions: dict[str, _Execution] = {}
        self.cells: dict[CellId, asyncio.Future[_Execution]] = {}
        self.invocations: dict[str, _Invocation] = {}
        self.undelivered: list[_Invocation] = []
        self.subscriptions: list[_Subscription] = []
        self.round_robin = itertools.count()
        self.retired_invocations = _Remembered()  # completed or revoked: completing is a no-op
        self.notifications: dict[str, asyncio.Future[None]] = {}
        self.wait_ids = _Remembered()
        self.waits: dict[str, _Wait] = {}
        self.cancelled_waits = _Remembered()
        self.early_yields = _Remembered()  # wait ids whose YieldObservation overtook the Wait
        self.early_execution_yields = _Remembered()  # the same for Execute's execution ids
        self.pending = 0  # invocations and notifications not yet finished
        self.opened = time.monotonic()
        self.cells_admitted = 0
        self.close_reason = ""

    # -- events ---------------------------------------------------------------------------------

    def send(self, event: pb.SessionEvent, key: str | None = None) -> None:
        """Queue ``event`` on the lease (``key`` names it for withdrawal)."""
        if not self.closed.is_set():
            self.lease.put(event, key)

    def cell(self, cell_id: CellId) -> asyncio.Future[_Execution]:
        future = self.cells.get(cell_id)
        if future is None:
            future = self.cells[cell_id] = asyncio.get_running_loop().create_future()
        return future

    def register(self, execution: _Execution, cell_id: CellId) -> None:
        execution.cell_id = cell_id
        future = self.cell(cell_id)
        if future.done():  # a cell id the runtime reused: the newest execution owns it
            future = self.cells[cell_id] = asyncio.get_running_loop().create_future()
        future.set_result(execution)

    # -- tool calls -----------------------------------------------------------------------------

    def route(self, invocation: _Invocation) -> None:
        matching = [sub for sub in self.subscriptions if sub.matches(invocation.name)]
        if not matching:
            self.undelivered.append(invocation)
            return
        chosen = matching[next(self.round_robin) % len(matching)]
        invocation.routed = chosen
        chosen.queue.put(invocation, invocation.invocation_id)

    def subscribe(self, subscription: _Subscription) -> None:
        self.subscriptions.append(subscription)
        waiting, self.undelivered = self.undelivered, []
        for invocation in waiting:
            self.route(invocation)

    def unsubscribe(self, subscription: _Subscription) -> None:
        with contextlib.suppress(ValueError):
            self.subscriptions.remove(subscription)
        # What it did not write yet goes to another subscription (or waits for one).
        for invocation in subscription.queue.take_all():
            invocation.routed = None
            self.route(invocation)

    def revoke_invocation(self, invocation_id: str, *, grace: bool = False) -> None:
        """The host no longer wants ``invocation_id``. With ``grace`` (the runtime revoked it)
        the call counts as finished only after the runtime's grace, as a local delegate's would:
        a client that ignores the cancellation delays a termination the same on every carrier."""
        invocation = self.invocations.pop(invocation_id, None)
        if invocation is None:
            return
        self.pending -= 1
        self.retired_invocations.add(invocation_id)
        routed = invocation.routed
        if routed is None:
            with contextlib.suppress(ValueError):
                self.undelivered.remove(invocation)
        elif not routed.queue.withdraw(invocation_id):
            # Written: the client may be running it. One never written is only taken back,
            # so a subscriber that does not read holds nothing of it (its input may be 64 MiB).
            self.send(
                pb.SessionEvent(
                    tool_call_cancelled=pb.ToolCallCancelled(invocation_id=invocation_id)
                )
            )
        _settle_later(invocation.future, CodeModeError(texts.SESSION_IS_CLOSED), grace)

    def revoke_notification(self, notification_id: str, *, grace: bool = False) -> None:
        """The host no longer waits for ``notification_id`` (``grace`` as for invocations)."""
        future = self.notifications.pop(notification_id, None)
        if future is None:
            return
        self.pending -= 1
        # A notification the lease has not written yet is only taken back: the client never
        # saw it, and a lease it does not read keeps nothing of it.
        if not self.lease.withdraw(notification_id):
            self.send(
                pb.SessionEvent(
                    notification_cancelled=pb.NotificationCancelled(notification_id=notification_id)
                )
            )
        _settle_later(future, None, grace)

    # -- the end --------------------------------------------------------------------------------

    def start_close(self, reason: str) -> asyncio.Task[None]:
        """Close the session (once; the first ``reason`` is the one logged)."""
        if self.close_task is None:
            self.closing = True
            self.close_reason = reason
            self.close_task = asyncio.ensure_future(self._close())
            self.host._keep(self.close_task)
        return self.close_task

    async def _close(self) -> None:
        for wait in list(self.waits.values()):
            wait.task.cancel()
        runtime = self.runtime
        try:
            if runtime is not None:
                await runtime.shutdown()
        except Exception:
            logger.exception("code-mode gRPC session %s: shutdown failed", self.session_id)
        finally:
            for invocation_id in list(self.invocations):
                self.revoke_invocation(invocation_id)
            for notification_id in list(self.notifications):
                self.revoke_notification(notification_id)
            for execution in self.executions.values():
                self.host._release_cell(execution)
            for subscription in list(self.subscriptions):
                subscription.queue.end()
            self.lease.end()
            self.closed.set()
            self.host._forget(self)
            logger.info(
                "event=session-close session=%s duration_ms=%d cells=%d reason=%s",
                self.session_id,
                (time.monotonic() - self.opened) * 1000,
                self.cells_admitted,
                self.close_reason,
            )


def _yield_early(started: StartedCell) -> None:
    """Apply a remembered YieldObservation (a carrier without early yields: nothing to do)."""
    try:
        started.yield_early()
    except CodeModeError as error:
        logger.debug("event=yield-ignored cell=%s reason=%s", started.cell_id, error.message)


def _settle_later(future: asyncio.Future[Any], outcome: object, grace: bool) -> None:
    """End a revoked callback's wait: at once, or after the runtime's grace."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
            future.exception()
        else:
            future.set_result(outcome)

    if grace:
        asyncio.get_running_loop().call_later(CALLBACK_GRACE, settle)
    else:
        settle()


def _loads_in_pieces(data: bytes) -> JSON:
    """``strict_json.loads(data)`` for a worker thread: what it returns or raises, but the long
    string literals (``pieces.LONG`` bytes or more) are decoded a piece at a time, each a C
    call of its own, so that the event loop gets the GIL in between (one parse held it 0.2-0.3 s
    for a tool output of 33 M backslashes). The rest, the skeleton, is parsed as ``loads`` parses
    a large text. A text this cannot take whole (not strict JSON, a long key repeated) is parsed
    by ``loads``, for its exact error."""
    try:
        parts = pieces.split(data)
        if parts.spans:
            skeleton = strict_json.loads_large(bytes(parts.skeleton))
            return cast(JSON, pieces.put_back(skeleton, parts.strings(), unique=True))
    except (ValueError, RecursionError):  # JSONError, msgspec.DecodeError
        pass
    return cast(JSON, strict_json.loads(data))


def _encoded_in_pieces(value: JSON) -> bytes:
    return bytes(cast(bytearray, pieces.encode(value)))


class _HostDelegate(CodeModeSessionDelegate):
    """A session's delegate on the host: every callback goes to the gRPC client."""

    def __init__(self, session: _Session) -> None:
        self._session = session

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        session = self._session
        if session.closing:
            raise CodeModeError(texts.SESSION_IS_CLOSED)
        if session.pending >= MAX_PENDING_DELEGATE_CALLS:
            raise CodeModeError(TOO_MANY_CALLBACKS)
        execution = await session.cell(invocation.cell_id)
        input_json = None
        try:
            if pieces.heavy(invocation.input):
                # Escaped text encodes at 250-500 MB/s: a piece at a time on a worker thread, not
                # in one call that holds the event loop every session shares (0.5 s for 63 M
                # backslashes).
                input_json = await asyncio.to_thread(
                    conversions.tool_input_json, invocation.input, _encoded_in_pieces
                )
            if execution.closed or cancellation.is_cancelled():
                raise CodeModeError(texts.SESSION_IS_CLOSED)
            execution.sequence += 1
            invocation_id = str(uuid.uuid4())
            message = conversions.tool_call_to_proto(
                invocation,
                session_id=session.session_id,
                execution_id=execution.execution_id,
                invocation_id=invocation_id,
                sequence=execution.sequence,
                input_json=input_json,
            )
        except WireConversionError as error:
            raise CodeModeError(error.message) from None
        future: asyncio.Future[JSON] = asyncio.get_running_loop().create_future()
        name = invocation.tool_name
        pending = _Invocation(invocation_id, message, _tool_key(name.name, name.namespace), future)
        session.invocations[invocation_id] = pending
        session.pending += 1
        session.route(pending)
        cancellation.add_callback(lambda: session.revoke_invocation(invocation_id, grace=True))
        return await future

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        session = self._session
        if session.closing:
            return
        if session.pending >= MAX_PENDING_DELEGATE_CALLS:
            raise CodeModeError(TOO_MANY_CALLBACKS)
        execution = await session.cell(cell_id)
        if execution.closed or cancellation.is_cancelled():
            return
        notification_id = str(uuid.uuid4())
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        session.notifications[notification_id] = future
        session.pending += 1
        event = pb.SessionEvent()
        notification = event.notification  # built in place: a nested message is copied whole
        notification.notification_id = notification_id
        notification.execution_id = execution.execution_id
        notification.cell_id = cell_id.value
        notification.call_id = call_id
        notification.text = text
        session.send(event, notification_id)
        cancellation.add_callback(lambda: session.revoke_notification(notification_id, grace=True))
        await future

    def cell_closed(self, cell_id: CellId) -> None:
        session = self._session
        future = session.cells.pop(cell_id, None)
        if future is None or not future.done():
            if future is not None:
                future.cancel()
            return
        execution = future.result()
        execution.closed = True
        session.executions.pop(execution.execution_id, None)
        session.host._release_cell(execution)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "event=cell-closed session=%s execution=%s cell=%s tool_calls=%d",
                session.session_id,
                execution.execution_id,
                cell_id,
                execution.sequence,
            )
        session.send(
            pb.SessionEvent(
                cell_closed=pb.CellClosed(
                    execution_id=execution.execution_id,
                    cell_id=cell_id.value,
                    final_tool_call_sequence=execution.sequence,
                )
            )
        )


class _Servicer(v1_pb2_grpc.CodeModeHostServicer):
    """The ``CodeModeHost`` rpcs; every status is chosen here (§12.1)."""

    def __init__(self, host: GrpcHost) -> None:
        self._host = host

    # -- helpers --------------------------------------------------------------------------------

    def _session(self, session_id: str, *, allow_closing: bool = False) -> _Session:
        # Any spelling of the UUID names the session (upstream parses it); the unknown-session
        # text repeats the spelling sent.
        session = self._host._sessions.get(self._identifier("session_id", session_id, uuid=True))
        if session is None:
            raise _Status(grpc.StatusCode.NOT_FOUND, texts.unknown_session(session_id))
        if session.closing and not allow_closing:
            raise _Status(grpc.StatusCode.CANCELLED, texts.SESSION_IS_CLOSED)
        return session

    @staticmethod
    def _identifier(field_name: str, value: str, *, uuid: bool = False) -> str:
        """``value`` checked (§3), as its canonical UUID spelling when ``uuid``."""
        try:
            check_request_identifier(field_name, value, uuid=uuid)
        except WireConversionError as error:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
        return canonical_uuid(value) if uuid else value

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        # The client's own requests only: answers to the host's (CompleteToolCall,
        # AcknowledgeNotification) never count (decision 0018).
        host = self._host
        if host._in_flight >= host.options.max_in_flight_requests:
            raise _Status(
                grpc.StatusCode.RESOURCE_EXHAUSTED, texts.HOST_TOO_MANY_IN_FLIGHT_REQUESTS
            )
        host._in_flight += 1
        try:
            yield
        finally:
            host._in_flight -= 1

    @staticmethod
    def _runtime_error(session: _Session, error: CodeModeError) -> _Status:
        if session.closing or error.message == SESSION_SHUTTING_DOWN:
            return _Status(grpc.StatusCode.CANCELLED, texts.SESSION_IS_CLOSED)
        if error.message.startswith("exec cell "):
            return _Status(grpc.StatusCode.FAILED_PRECONDITION, error.message)
        if isinstance(error, EngineLimitError):  # an admission limit of the host (§12.1)
            return _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, error.message)
        return _Status(grpc.StatusCode.INTERNAL, error.message)

    @staticmethod
    async def _abort(context: Context, status: _Status) -> NoReturn:
        await context.abort(status.code, status.message)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the lease ------------------------------------------------------------------------------

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: Context
    ) -> AsyncIterator[pb.SessionEvent]:
        host = self._host
        limits = CodeModeSessionCellExecutionLimits()
        if request.HasField("cell_execution_limits"):
            limits = conversions.limits_to_domain(request.cell_execution_limits)
        if host._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, texts.HOST_SHUTTING_DOWN)
        bound = host.options.max_sessions
        if bound is not None and len(host._sessions) + host._opening >= bound:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, texts.HOST_TOO_MANY_OPEN_SESSIONS
            )
        session = _Session(host, str(uuid.uuid4()))
        host._opening += 1
        try:
            runtime = await host.provider.create_session_with_limits(_HostDelegate(session), limits)
        except CodeModeError as error:
            if error.message.startswith(texts.invalid_session_limits("")):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
            if error.message == PROVIDER_DOES_NOT_SUPPORT_LIMITS and (
                limits.max_heap_size_bytes is not None
            ):
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, texts.HOST_CANNOT_ENFORCE_HEAP_LIMITS
                )
            if error.message == PROVIDER_DOES_NOT_SUPPORT_LIMITS:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, texts.invalid_session_limits(error.message)
                )
            await context.abort(grpc.StatusCode.UNAVAILABLE, error.message)
        finally:
            host._opening -= 1
        session.runtime = runtime
        session.opened = time.monotonic()
        host._sessions[session.session_id] = session
        logger.info("event=session-open session=%s peer=%s", session.session_id, context.peer())
        try:
            yield pb.SessionEvent(opened=pb.SessionOpened(session_id=session.session_id))
            while True:
                event = await session.lease.get()
                if event is None:
                    return
                yield event
        finally:
            # Dropped lease (cancelled, disconnected) or an orderly close: the session ends.
            session.start_close("lease-ended")

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Context
    ) -> pb.CloseSessionResponse:
        try:
            with self._in_flight():
                session = self._session(request.session_id, allow_closing=True)
                closing = session.start_close("close-session")
                try:
                    async with asyncio.timeout(self._host.options.session_shutdown_timeout):
                        await asyncio.shield(closing)
                except TimeoutError:
                    raise _Status(
                        grpc.StatusCode.DEADLINE_EXCEEDED, texts.SESSION_SHUTDOWN_TIMED_OUT
                    ) from None
        except _Status as status:
            await self._abort(context, status)
        return pb.CloseSessionResponse()

    # -- tool calls -----------------------------------------------------------------------------

    async def SubscribeToToolCalls(
        self, request: pb.SubscribeToToolCallsRequest, context: Context
    ) -> AsyncIterator[pb.ToolCall]:
        try:
            session = self._session(request.session_id)
            if len(session.subscriptions) >= MAX_SUBSCRIPTIONS_PER_SESSION:
                raise _Status(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, texts.SESSION_TOO_MANY_SUBSCRIPTIONS
                )
            # Counted before anything is built from them (the count of a repeated field is free).
            named = sum(len(subscription.names) for subscription in session.subscriptions)
            if named + len(request.tool_names) > MAX_SUBSCRIBED_TOOL_NAMES:
                raise _Status(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, texts.SESSION_TOO_MANY_SUBSCRIBED_TOOLS
                )
        except _Status as status:
            await self._abort(context, status)
        names = frozenset(
            _tool_key(name.name, name.namespace if name.HasField("namespace") else None)
            for name in request.tool_names
        )
        subscription = _Subscription(names)
        session.subscribe(subscription)
        # The response headers go out now, not with the first ToolCall: a client may wait for
        # them before it sends its first Execute (upstream Codex 0.171 does).
        await context.send_initial_metadata(())
        try:
            while True:
                invocation = await subscription.queue.get()
                if invocation is None:
                    return
                yield invocation.message
        finally:
            session.unsubscribe(subscription)

    async def CompleteToolCall(
        self, request: pb.CompleteToolCallRequest, context: Context
    ) -> pb.CompleteToolCallResponse:
        # Not an in-flight request (decision 0018): it answers the host's own ToolCall, as a V1
        # delegate response does (protocol-v1.md §8.7), bounded by the pending invocations;
        # refused on a busy host, the client fails its whole session (§6.3).
        try:
            parsed: list[JSON] = []
            while True:
                session = self._session(request.session_id)
                invocation_id = self._identifier("invocation_id", request.invocation_id, uuid=True)
                invocation = session.invocations.get(invocation_id)
                if invocation is None:
                    # Upstream 0.171.0 answers OK to a completion of an invocation it issued and
                    # no longer waits for (completed, cancelled, its cell ended); NOT_FOUND is for
                    # ids it never issued.
                    if invocation_id in session.retired_invocations:
                        return pb.CompleteToolCallResponse()
                    raise _Status(
                        grpc.StatusCode.NOT_FOUND, texts.unknown_invocation(invocation_id)
                    )
                # An invalid completion is refused and changes nothing: the invocation still
                # waits for a valid one, as upstream 0.171.0's host does (§6.3 rejected the
                # cell's call).
                outcome = request.WhichOneof("outcome")
                output = request.succeeded.output_json
                if parsed or outcome != "succeeded" or len(output) < pieces.LONG:
                    break
                # A long output is parsed on a worker thread, its long strings a piece at a
                # time; then everything above is looked at again (the session or the
                # invocation may have ended meanwhile).
                try:
                    parsed.append(await asyncio.to_thread(_loads_in_pieces, output))
                except strict_json.JSONError as error:
                    raise _Status(
                        grpc.StatusCode.INVALID_ARGUMENT, texts.tool_output_not_json(str(error))
                    ) from None
            value: JSON = None
            if parsed:
                value = parsed[0]
            elif outcome == "succeeded":
                try:
                    value = strict_json.loads(output)
                except strict_json.JSONError as error:
                    raise _Status(
                        grpc.StatusCode.INVALID_ARGUMENT, texts.tool_output_not_json(str(error))
                    ) from None
            elif outcome != "failed":
                raise _Status(
                    grpc.StatusCode.INVALID_ARGUMENT, texts.TOOL_COMPLETION_MISSING_OUTCOME
                )
            del session.invocations[invocation_id]
            session.pending -= 1
            session.retired_invocations.add(invocation_id)
            if outcome == "succeeded":
                invocation.future.set_result(value)
            else:
                invocation.future.set_exception(CodeModeError(request.failed.message))
        except _Status as status:
            await self._abort(context, status)
        return pb.CompleteToolCallResponse()

    async def AcknowledgeNotification(
        self, request: pb.AcknowledgeNotificationRequest, context: Context
    ) -> pb.AcknowledgeNotificationResponse:
        # Not an in-flight request either (see CompleteToolCall): without it the cell never ends.
        try:
            session = self._session(request.session_id)
            notification_id = self._identifier(
                "notification_id", request.notification_id, uuid=True
            )
            future = session.notifications.pop(notification_id, None)
            if future is None:
                # Upstream 0.171.0 answers OK to any acknowledgement of a well-formed id: unknown,
                # twice, or after its NotificationCancelled.
                return pb.AcknowledgeNotificationResponse()
            session.pending -= 1
            if not future.done():
                future.set_result(None)
        except _Status as status:
            await self._abort(context, status)
        return pb.AcknowledgeNotificationResponse()

    # -- executions -----------------------------------------------------------------------------

    async def Execute(
        self, request: pb.ExecuteRequest, context: Context
    ) -> AsyncIterator[pb.ExecuteEvent]:
        received = time.monotonic_ns()
        host = self._host
        try:
            with self._in_flight():
                session = self._session(request.session_id)
                execution_id = self._identifier("execution_id", request.execution_id)
                try:
                    domain = conversions.execute_request_to_domain(request)
                except WireConversionError as error:
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
                if execution_id in session.execution_ids or execution_id in session.executions:
                    raise _Status(
                        grpc.StatusCode.ALREADY_EXISTS, texts.execution_id_reused(execution_id)
                    )
                if host._stopping:
                    raise _Status(grpc.StatusCode.UNAVAILABLE, texts.HOST_SHUTTING_DOWN)
                if host._active_cells >= host.options.max_active_cells:
                    raise _Status(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, texts.HOST_TOO_MANY_ACTIVE_CELLS
                    )
                session.execution_ids.add(execution_id)
                execution = _Execution(execution_id, holds_slot=True)
                if execution_id in session.early_execution_yields:
                    session.early_execution_yields.discard(execution_id)
                    execution.yield_requested = True
                host._active_cells += 1
                session.executions[execution_id] = execution
                runtime = session.runtime
                assert runtime is not None
                admitted = False
                try:
                    started = await runtime.execute(domain)
                    admitted = True
                except CodeModeError as error:
                    raise self._runtime_error(session, error) from None
                finally:
                    if not admitted:
                        session.executions.pop(execution_id, None)
                        host._release_cell(execution)
                session.register(execution, started.cell_id)
                session.cells_admitted += 1
                execution.started = started
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "event=cell-admitted session=%s execution=%s cell=%s",
                        session.session_id,
                        execution_id,
                        started.cell_id,
                    )
                if execution.yield_requested:
                    _yield_early(started)  # yields as soon as the observation attaches
                try:
                    yield pb.ExecuteEvent(
                        started=pb.ExecutionStarted(
                            execution_id=execution_id, cell_id=started.cell_id.value
                        )
                    )
                    try:
                        response = await started.initial_response()
                    except CodeModeError as error:
                        raise self._runtime_error(session, error) from None
                except BaseException:
                    started.cancel()  # abandoned (or failed): the cell is terminated
                    raise
                finally:
                    execution.started = None
                duration = time.monotonic_ns() - received
                yield conversions.outcome_event(response, duration)
        except _Status as status:
            await self._abort(context, status)

    async def Wait(self, request: pb.WaitRequest, context: Context) -> pb.WaitResponse:
        received = time.monotonic_ns()
        try:
            with self._in_flight():
                session = self._session(request.session_id)
                try:  # the cell id first, as upstream checks them
                    domain = conversions.wait_request_to_domain(request)
                except WireConversionError as error:
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
                wait_id = self._identifier("wait_id", request.wait_id)
                if wait_id in session.wait_ids or wait_id in session.waits:
                    raise _Status(grpc.StatusCode.ALREADY_EXISTS, texts.wait_id_reused(wait_id))
                session.wait_ids.add(wait_id)
                if wait_id in session.cancelled_waits:
                    session.cancelled_waits.discard(wait_id)
                    raise _Status(grpc.StatusCode.CANCELLED, texts.WAIT_WAS_CANCELLED)
                runtime = session.runtime
                assert runtime is not None
                # YieldObservation sets it (one that overtook the Wait: already set).
                early_yield = asyncio.Event()
                if wait_id in session.early_yields:
                    session.early_yields.discard(wait_id)
                    early_yield.set()
                task = asyncio.ensure_future(runtime.wait(domain, early_yield=early_yield))
                wait = _Wait(task, domain.cell_id, early_yield)
                session.waits[wait_id] = wait
                try:
                    try:
                        await asyncio.wait((task,))
                    except asyncio.CancelledError:
                        task.cancel()  # the transport cancelled the Wait: detach
                        raise
                finally:
                    session.waits.pop(wait_id, None)
                outcome = self._wait_outcome(session, wait, task)
        except _Status as status:
            await self._abort(context, status)
        return conversions.wait_outcome_to_proto(outcome, time.monotonic_ns() - received)

    def _wait_outcome(
        self, session: _Session, wait: _Wait, task: asyncio.Task[WaitOutcome]
    ) -> WaitOutcome:
        # A Wait the session's close (CloseSession, a dropped lease) ended is cancelled like one
        # CancelWait ended: upstream 0.171.0 says "code-mode wait was cancelled" for both.
        if wait.cancelled or task.cancelled():
            raise _Status(grpc.StatusCode.CANCELLED, texts.WAIT_WAS_CANCELLED)
        error = task.exception()
        if isinstance(error, CodeModeError):
            if session.closing:
                raise _Status(grpc.StatusCode.CANCELLED, texts.WAIT_WAS_CANCELLED)
            raise self._runtime_error(session, error)
        return task.result()

    async def YieldObservation(
        self, request: pb.YieldObservationRequest, context: Context
    ) -> pb.YieldObservationResponse:
        try:
            with self._in_flight():
                session = self._session(request.session_id)
                which = request.WhichOneof("observation")
                if which is None:
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, texts.MISSING_OBSERVATION_ID)
                if which == "wait_id":
                    wait_id = self._identifier("wait_id", request.wait_id)
                    wait = session.waits.get(wait_id)
                    if wait is not None:
                        wait.early_yield.set()  # a no-op once the Wait has its outcome
                    elif wait_id not in session.wait_ids:
                        session.early_yields.add(wait_id)
                else:
                    execution_id = self._identifier("execution_id", request.execution_id)
                    execution = session.executions.get(execution_id)
                    if execution is not None:
                        if execution.started is not None:
                            try:
                                execution.started.yield_early()
                            except CodeModeError as error:
                                raise _Status(
                                    grpc.StatusCode.UNIMPLEMENTED, error.message
                                ) from None
                        elif execution.cell_id is None:  # not admitted yet
                            execution.yield_requested = True
                    elif execution_id not in session.execution_ids:
                        session.early_execution_yields.add(execution_id)
        except _Status as status:
            await self._abort(context, status)
        return pb.YieldObservationResponse()

    async def CancelWait(
        self, request: pb.CancelWaitRequest, context: Context
    ) -> pb.CancelWaitResponse:
        try:
            with self._in_flight():
                session = self._session(request.session_id)
                wait_id = self._identifier("wait_id", request.wait_id)
                wait = session.waits.get(wait_id)
                if wait is not None:
                    if not wait.task.done():
                        wait.cancelled = True
                        wait.task.cancel()
                    # The observer retires when its task ends (it detaches on cancellation).
                    await asyncio.wait((wait.task,))
                elif wait_id not in session.wait_ids:
                    session.cancelled_waits.add(wait_id)
        except _Status as status:
            await self._abort(context, status)
        return pb.CancelWaitResponse()

    async def Terminate(self, request: pb.TerminateRequest, context: Context) -> pb.WaitResponse:
        received = time.monotonic_ns()
        try:
            with self._in_flight():
                session = self._session(request.session_id)
                cell_id = CellId(self._identifier("cell_id", request.cell_id))
                runtime = session.runtime
                assert runtime is not None
                try:
                    outcome = await runtime.terminate(cell_id)
                except CodeModeError as error:
                    raise self._runtime_error(session, error) from None
        except _Status as status:
            await self._abort(context, status)
        return conversions.wait_outcome_to_proto(outcome, time.monotonic_ns() - received)


class GrpcHost:
    """Serves a session provider as ``codex.code_mode.v1.CodeModeHost`` on a ``grpc.aio`` server.

    Use :meth:`start`, then :meth:`shutdown` (graceful) or :meth:`aclose`. ``address`` is a
    :class:`GrpcAddress` or a ``grpc://ADDR:PORT`` URL. ``token``: when set, every
    ``CodeModeHost`` rpc must carry ``authorization: Bearer <token>`` (health stays open).
    ``tls``: serve TLS with this identity instead of plaintext HTTP/2.
    """

    def __init__(
        self,
        provider: CodeModeSessionProvider,
        address: GrpcAddress | str = "grpc://127.0.0.1:0",
        *,
        options: GrpcHostOptions | None = None,
        health: bool = True,
        token: str | None = None,
        tls: GrpcTls | None = None,
    ) -> None:
        if token is not None and not token:
            raise ValueError("the token is empty")
        self.provider = provider
        self._token = token
        self._tls = tls
        self.options = options or GrpcHostOptions()
        self._address = GrpcAddress.parse(address) if isinstance(address, str) else address
        self._port = self._address.port
        self._server: aio.Server | None = None
        self._sessions: dict[str, _Session] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._in_flight = 0
        self._active_cells = 0
        self._opening = 0  # OpenSession calls creating their session (for max_sessions)
        self._stopping = False
        self._health_enabled = health
        self._health: Any = None

    @property
    def url(self) -> str:
        """``grpc://ADDR:PORT`` (with the bound port once started)."""
        return self._address.url(self._port)

    @property
    def active_cells(self) -> int:
        """Cells admitted and not yet closed, over every session."""
        return self._active_cells

    @property
    def sessions(self) -> int:
        """Open sessions."""
        return len(self._sessions)

    async def start(self) -> str:
        """Bind and start serving; returns ``grpc://ADDR:PORT``."""
        if _GRPC_IMPORTED_FIRST and os.environ.get("GRPC_ENABLE_FORK_SUPPORT") != "false":
            logger.warning(
                "grpc was imported before codemode.host.grpc: set GRPC_ENABLE_FORK_SUPPORT=false, "
                "or engine processes may crash while they start"
            )
        interceptors: list[aio.ServerInterceptor] = [_RequestDecodingInterceptor()]
        if self._token is not None:  # first: a refused call is refused whatever it carries
            interceptors.insert(0, _BearerTokenInterceptor(self._token))
        server = aio.server(options=self.options.server_options(), interceptors=interceptors)
        v1_pb2_grpc.add_CodeModeHostServicer_to_server(_Servicer(self), server)
        if self._health_enabled:
            self._health = _add_health(server)
        try:
            target = self._address.bind_target()
            if self._tls is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, self._tls.credentials())
        except RuntimeError as error:  # grpc reports a failed bind this way
            raise OSError(f"cannot listen on {self._address.url()}: {error}") from None
        if port == 0:
            raise OSError(f"cannot listen on {self._address.url()}")
        await server.start()
        self._server = server
        self._port = port
        if self._health is not None:
            for service in ("", SERVICE_NAME):
                await self._health.set(service, _SERVING)
        logger.info(
            "event=listening url=%s auth=%s tls=%s",
            self.url,
            "token" if self._token is not None else "none",
            "on" if self._tls is not None else "off",
        )
        return self.url

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _forget(self, session: _Session) -> None:
        if self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]

    def _release_cell(self, execution: _Execution) -> None:
        if execution.holds_slot:
            execution.holds_slot = False
            self._active_cells -= 1

    async def _stop_admitting(self) -> None:
        self._stopping = True
        if self._health is not None:
            for service in ("", SERVICE_NAME):
                await self._health.set(service, _NOT_SERVING)

    async def shutdown(self, grace: float) -> None:
        """Stop admitting (health ``NOT_SERVING``; new sessions and executions are
        ``UNAVAILABLE``), give running cells up to ``grace`` seconds, then close everything."""
        await self._stop_admitting()
        started = time.monotonic()
        deadline = started + grace
        while self._active_cells and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        logger.info(
            "event=drained duration_ms=%d sessions=%d cells_left=%d",
            (time.monotonic() - started) * 1000,
            len(self._sessions),
            self._active_cells,
        )
        await self.aclose()

    async def aclose(self) -> None:
        """Close every session (terminating its cells) and stop the server."""
        await self._stop_admitting()
        sessions = list(self._sessions.values())
        closing = [session.start_close("host-shutdown") for session in sessions]
        if closing:
            await asyncio.wait(closing, timeout=self.options.session_shutdown_timeout)
        server = self._server
        if server is not None:
            self._server = None
            await server.stop(0.5)
        if self._background:
            await asyncio.wait(list(self._background), timeout=1.0)


_SERVING: Final = 1  # grpc.health.v1.HealthCheckResponse.SERVING
_NOT_SERVING: Final = 2


def _add_health(server: aio.Server) -> Any:
    """Serve ``grpc.health.v1.Health`` when ``grpcio-health-checking`` is installed."""
    try:
        from grpc_health.v1 import (  # type: ignore[import-untyped, unused-ignore]
            health_pb2_grpc,
        )
        from grpc_health.v1.health import (  # type: ignore[import-untyped, unused-ignore]
            aio as health_aio,
        )
    except ImportError:
        logger.info("grpcio-health-checking is not installed: no grpc.health.v1 service")
        return None
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def serve_grpc(
    provider: CodeModeSessionProvider,
    listen: str,
    *,
    stop: asyncio.Event,
    options: GrpcHostOptions | None = None,
    shutdown_grace: float = 0.0,
    ready: Callable[[str], object] | None = None,
    token: str | None = None,
    tls: GrpcTls | None = None,
) -> None:
    """Serve ``provider`` on ``listen`` (``grpc://ADDR:PORT``) until ``stop`` is set, then shut
    down gracefully. ``ready(url)`` is called once bound (the CLI prints it as stdout's first
    line). ``token`` and ``tls`` as for :class:`GrpcHost`. Raises :class:`ValueError` for a bad
    URL and :class:`OSError` when it cannot bind."""
    host = GrpcHost(provider, GrpcAddress.parse(listen), options=options, token=token, tls=tls)
    try:
        url = await host.start()
        if ready is not None:
            ready(url)
        await stop.wait()
        logger.info("event=shutting-down grace=%s", shutdown_grace)
        await host.shutdown(shutdown_grace)
    finally:
        await host.aclose()
