"""Remote sessions on a WebSocket host (``protocol-v1.md`` §7.2, §7.3).

:func:`connect_websocket` opens the control socket, handshakes (asking for ``dual-websocket-v1``
when ``dual``; a host that does not grant it is used over the one socket), opens the bulk socket
at the bulk URL when granted, and returns the running :class:`~codemode.client.v1.V1ClientConnection`.
:class:`WebSocketCodeModeSessionProvider` shares one such connection among its sessions and
reconnects after it died.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

from codemode.client.provider import SharedConnectionProvider
from codemode.client.v1 import RemoteSession, V1ClientConnection, connect_v1
from codemode.errors import CodeModeError
from codemode.protocol.constants import (
    HANDSHAKE_TIMEOUT,
    MAX_WEBSOCKET_MESSAGE_BYTES,
    SHUTDOWN_TIMEOUT,
)
from codemode.protocol.deadlines import DEFAULT_RESPONSE_TIMEOUT
from codemode.protocol.options import checked_seconds
from codemode.protocol.texts import host_unreachable
from codemode.protocol.v1.revision import WireRevision
from codemode.protocol.v1.urls import bulk_url
from codemode.transports.base import describe
from codemode.transports.websocket import (
    CLOSE_TIMEOUT,
    WRITE_HIGH_WATER,
    PushClientConnection,
    WebSocketTransport,
)

__all__ = ["WebSocketCodeModeSessionProvider", "WebSocketLink", "connect_websocket"]


async def _open(url: str, token: str | None, settings: dict[str, Any]) -> ClientConnection:
    headers = None if token is None else {"Authorization": f"Bearer {token}"}
    try:
        return await connect(
            url,
            additional_headers=headers,
            compression=None,
            max_size=MAX_WEBSOCKET_MESSAGE_BYTES,
            max_queue=4,
            proxy=None,
            close_timeout=CLOSE_TIMEOUT,
            write_limit=WRITE_HIGH_WATER,
            create_connection=PushClientConnection,  # messages pushed to the transport
            **settings,
        )
    except InvalidStatus as error:
        raise CodeModeError(host_unreachable(url, f"HTTP {error.response.status_code}")) from None
    except (OSError, InvalidHandshake, TimeoutError) as error:
        raise CodeModeError(host_unreachable(url, describe(error))) from None


async def connect_websocket(
    url: str,
    *,
    dual: bool = False,
    token: str | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    wire_revision: WireRevision | str = WireRevision.PINNED,
    ping_interval: float | None = 20.0,
    ping_timeout: float | None = 20.0,
    response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
) -> V1ClientConnection:
    """Connect to the host at ``url`` (``ws://`` or ``wss://``) and handshake.

    ``token`` is sent as ``Authorization: Bearer`` on both sockets; ``ping_interval`` and
    ``ping_timeout`` are each socket's keepalive, ``response_timeout`` each request's time past
    its runtime allowance (as on the provider). Raises
    :class:`CodeModeError`: the host cannot be reached, or C2-C6.
    """
    settings: dict[str, Any] = {
        "open_timeout": handshake_timeout,
        "ping_interval": ping_interval,
        "ping_timeout": ping_timeout,
    }
    # The client never pauses its reading for its own writes: the host pauses for its writes,
    # and two ends doing that could each wait for the other to read (decision 0014).
    transport = WebSocketTransport(await _open(url, token, settings), pause_while_backlogged=False)

    async def open_bulk(bulk_token: str) -> None:
        transport.attach_bulk(await _open(bulk_url(url, bulk_token), token, settings))

    return await connect_v1(
        transport,
        dual=dual,
        handshake_timeout=handshake_timeout,
        open_bulk=open_bulk if dual else None,
        wire_revision=wire_revision,
        response_timeout=response_timeout,
    )


class WebSocketLink:
    """One WebSocket connection to a host, as a provider holds it."""

    def __init__(self, connection: V1ClientConnection) -> None:
        self.connection = connection

    @property
    def finished(self) -> bool:
        return not self.connection.is_alive()

    def is_alive(self) -> bool:
        return self.connection.is_alive()

    async def aclose(self, sessions: Sequence[RemoteSession] = ()) -> None:
        if self.connection.is_alive() and sessions:
            async with asyncio.timeout(SHUTDOWN_TIMEOUT):
                await asyncio.gather(
                    *(session.shutdown() for session in sessions), return_exceptions=True
                )
        await self.connection.aclose()


def _optional_seconds(name: str, value: float | None) -> float | None:
    return None if value is None else checked_seconds(name, value)


class WebSocketCodeModeSessionProvider(SharedConnectionProvider[WebSocketLink]):
    """Creates :class:`RemoteSession` objects on one shared WebSocket connection to ``url``.

    ``dual`` asks for the control + bulk pair (falling back to one socket when the host does not
    grant it); ``token`` is the host's bearer token. Every ``ping_interval`` seconds each socket
    pings the host; a pong that takes longer than ``ping_timeout`` ends the connection, failing
    its pending calls (``None``: no pings, or no limit): a silent host is noticed, idle or busy.
    A request unanswered for ``response_timeout`` seconds (default 60) past its runtime allowance
    ends it too (a host whose socket answers pings while it hangs). The connection is made on
    first use and replaced after it died. Close with :meth:`aclose`.
    """

    def __init__(
        self,
        url: str,
        *,
        dual: bool = False,
        token: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        wire_revision: WireRevision | str = WireRevision.PINNED,
        ping_interval: float | None = 20.0,
        ping_timeout: float | None = 20.0,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
    ) -> None:
        super().__init__()
        self.url = url
        self.response_timeout = checked_seconds("response_timeout", response_timeout)
        self.dual = dual
        self.wire_revision = WireRevision(wire_revision)
        self._token = token
        self._handshake_timeout = handshake_timeout
        # Checked here, not at the first connection, where a bad value failed inside websockets.
        self._ping_interval = _optional_seconds("ping_interval", ping_interval)
        self._ping_timeout = _optional_seconds("ping_timeout", ping_timeout)

    async def _connect(self) -> WebSocketLink:
        connection = await connect_websocket(
            self.url,
            dual=self.dual,
            token=self._token,
            handshake_timeout=self._handshake_timeout,
            wire_revision=self.wire_revision,
            ping_interval=self._ping_interval,
            ping_timeout=self._ping_timeout,
            response_timeout=self.response_timeout,
        )
        return WebSocketLink(connection)
