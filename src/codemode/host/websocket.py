"""Serve Protocol V1 over WebSocket (``protocol-v1.md`` §7.1-§7.3): one listener, many
connections, each a single socket or a control + bulk pair.

:class:`WebSocketHost` answers the HTTP side itself — ``GET /readyz``, 403 for browsers (any
``Origin``), 401 without the bearer token (``Authorization: Bearer <token>``, the scheme in any
case) when one is configured, 404 for unknown paths and for unknown, expired or reused bulk tokens
(a bulk token expires with its control socket too), 503 past ``max_connections`` or while shutting
down — and hands every accepted control socket to a :class:`~codemode.host.v1.V1HostConnection`. A
bulk socket is paired to its control connection by the single-use token of ``connection/ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response
from websockets.protocol import State

from codemode.host.address import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PING_INTERVAL,
    DEFAULT_PING_TIMEOUT,
    WebSocketAddress,
    is_loopback,
)
from codemode.host.auth import bearer_token_matches
from codemode.host.v1 import HostOptions, V1HostConnection
from codemode.protocol.constants import DUAL_WEBSOCKET_CAPABILITY, MAX_WEBSOCKET_MESSAGE_BYTES
from codemode.protocol.options import checked_count, checked_seconds
from codemode.session import CodeModeSessionProvider
from codemode.transports.base import TransportError
from codemode.transports.websocket import (
    CLOSE_TIMEOUT,
    WRITE_HIGH_WATER,
    PushServerConnection,
    WebSocketTransport,
)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PING_INTERVAL",
    "DEFAULT_PING_TIMEOUT",
    "WebSocketAddress",
    "WebSocketHost",
    "is_loopback",
]

logger = logging.getLogger("codemode.host")


@dataclass(slots=True)
class _Pairing:
    transport: WebSocketTransport
    arrived: asyncio.Future[None]


class WebSocketHost:
    """Serves a session provider over V1 on a WebSocket listener.

    ``token``: when set, both sockets must carry ``Authorization: Bearer <token>``. ``dual``:
    grant ``dual-websocket-v1`` to clients that ask (a second socket for tool calls and their
    results). Use :meth:`start`, then :meth:`shutdown` (graceful) or :meth:`aclose`.
    """

    def __init__(
        self,
        provider: CodeModeSessionProvider,
        address: WebSocketAddress,
        *,
        options: HostOptions | None = None,
        token: str | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        ping_interval: float | None = DEFAULT_PING_INTERVAL,
        ping_timeout: float | None = DEFAULT_PING_TIMEOUT,
        dual: bool = True,
    ) -> None:
        options = options or HostOptions()
        capabilities = options.capabilities - {DUAL_WEBSOCKET_CAPABILITY}
        if dual:
            capabilities |= {DUAL_WEBSOCKET_CAPABILITY}
        self._options = replace(options, capabilities=capabilities)
        self._provider = provider
        self._address = address
        self._token = None if token is None else token.encode()
        self._max_connections = checked_count("max_connections", max_connections)
        self._ping_interval = (
            None if ping_interval is None else checked_seconds("ping_interval", ping_interval)
        )
        self._ping_timeout = (
            None if ping_timeout is None else checked_seconds("ping_timeout", ping_timeout)
        )
        self._bulk_prefix = address.path.rstrip("/") + "/bulk/"
        self._server: Server | None = None
        self._port = address.port
        self._served: dict[V1HostConnection, WebSocketTransport] = {}
        self._pairings: dict[str, _Pairing] = {}
        # Bulk sockets whose upgrade was accepted, until their handler takes them. Weak: a
        # handshake that fails after the token check (a bad key, a peer gone) never reaches the
        # handler, and must not keep its connection (and the control's transport) forever.
        self._bulk: weakref.WeakKeyDictionary[ServerConnection, _Pairing] = (
            weakref.WeakKeyDictionary()
        )
        self._ids = itertools.count(1)
        self._stopping = False

    @property
    def url(self) -> str:
        """The control URL (with the bound port once started)."""
        return self._address.url(self._port)

    async def start(self) -> str:
        """Bind and start accepting; returns the control URL."""
        self._server = await serve(
            self._handle,
            self._address.host,
            self._address.port,
            process_request=self._process_request,
            compression=None,
            max_size=MAX_WEBSOCKET_MESSAGE_BYTES,
            max_queue=4,
            ping_interval=self._ping_interval,
            ping_timeout=self._ping_timeout,
            close_timeout=CLOSE_TIMEOUT,
            write_limit=WRITE_HIGH_WATER,
            create_connection=PushServerConnection,  # messages pushed to the transport
            server_header=None,
            logger=logging.getLogger("codemode.host.websocket"),
        )
        sockets = list(self._server.sockets)
        if sockets:
            self._port = sockets[0].getsockname()[1]
        return self.url

    # -- the HTTP side ----------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        upgrade = "websocket" in request.headers.get("Upgrade", "").lower()
        if not upgrade:
            if path == "/readyz":
                return connection.respond(200, "ok\n")
            return connection.respond(404, "not found\n")
        if "Origin" in request.headers:
            return connection.respond(403, "browsers may not connect to a code-mode host\n")
        if self._token is not None:
            given = request.headers.get("Authorization", "").encode()
            if not bearer_token_matches(given, self._token):
                return connection.respond(401, "a bearer token is required\n")
        if path == self._address.path:
            if self._stopping:
                return connection.respond(503, "the host is shutting down\n")
            if len(self._served) >= self._max_connections:
                return connection.respond(503, "too many connections\n")
            return None
        if path.startswith(self._bulk_prefix):
            pairing = self._pairings.pop(path[len(self._bulk_prefix) :], None)
            # A token dies with its control socket (§7.3: expired, 404) the moment that socket
            # ends, not when the pairing timeout does nor once the connection's sessions are shut
            # down: a bulk socket must not be accepted only to be closed.
            if (
                pairing is None
                or pairing.arrived.done()
                or pairing.transport.control.state is not State.OPEN
            ):
                return connection.respond(404, "unknown bulk connection token\n")
            self._bulk[connection] = pairing
            return None
        return connection.respond(404, "not found\n")

    # -- connections ----------------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        pairing = self._bulk.pop(connection, None)
        if pairing is not None:
            await self._serve_bulk(connection, pairing)
            return
        await self._serve_control(connection)

    async def _serve_bulk(self, connection: ServerConnection, pairing: _Pairing) -> None:
        if pairing.arrived.done():
            # The pairing expired (or its control socket ended) between the upgrade's token
            # check and this handler: the answer had gone out, so the socket is closed instead.
            await connection.close()
            return
        try:
            pairing.transport.attach_bulk(connection)
        except TransportError:
            return  # its control connection already ended
        pairing.arrived.set_result(None)
        await connection.wait_closed()

    async def _serve_control(self, connection: ServerConnection) -> None:
        number = next(self._ids)
        transport = WebSocketTransport(connection)
        tokens: list[str] = []

        async def pair_bulk(token: str) -> None:
            arrived = asyncio.get_running_loop().create_future()
            self._pairings[token] = _Pairing(transport, arrived)
            tokens.append(token)
            try:
                await arrived
            finally:
                self._pairings.pop(token, None)  # single use, and forgotten when expired

        served = V1HostConnection(
            transport, self._provider, self._options.protocol(), pair_bulk=pair_bulk
        )
        self._served[served] = transport
        peer = _peer(connection)
        logger.info("event=connection-open connection=%d peer=%s", number, peer)
        started = time.monotonic()
        outcome = "error"
        try:
            outcome = "clean" if await served.serve() else "error"
        finally:
            del self._served[served]
            for token in tokens:  # forgotten with the connection, not at the pairing timeout
                pairing = self._pairings.pop(token, None)
                if pairing is not None:
                    pairing.arrived.cancel()
            await transport.close()
            failure = served.protocol.failure
            logger.info(
                "event=connection-close connection=%d peer=%s seconds=%.3f outcome=%s%s",
                number,
                peer,
                time.monotonic() - started,
                outcome,
                "" if failure is None else f" reason={failure!r}",
            )

    # -- the end ------------------------------------------------------------------------------------

    def active_cells(self) -> int:
        """Cells admitted on every connection and not yet closed."""
        return sum(served.protocol.active_cells for served in self._served)

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, refuse new requests (H4), give running cells up to ``grace`` seconds
        to end, then close every connection (which terminates what still runs)."""
        self._stopping = True
        server = self._server
        if server is not None:
            server.close(close_connections=False)
        for served in list(self._served):
            served.stop_admitting()
        deadline = time.monotonic() + grace
        while self.active_cells() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.aclose()

    async def aclose(self) -> None:
        """Close the listener and every connection; their sessions are shut down."""
        self._stopping = True
        server = self._server
        if server is not None:
            server.close(close_connections=False)
        transports = list(self._served.values())
        await asyncio.gather(*(t.close() for t in transports), return_exceptions=True)
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()


def _peer(connection: ServerConnection) -> str:
    address = connection.remote_address
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
