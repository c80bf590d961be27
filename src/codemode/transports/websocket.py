"""V1 frames over WebSocket: one socket, or a control + bulk pair (``protocol-v1.md`` §6.4, §7).

Every binary message carries exactly one frame; the transport hands each message over whole
(``whole_frames``) and never looks inside. On a pair, control is read first whenever both sockets
have a message ready, so a large tool result on the bulk socket never delays an answer on the
control socket. Frames are written at once, in order; what waits to be written is bounded by
:meth:`WebSocketTransport.drain`, and each socket's reader holds at most one message its
consumer has not taken, so a peer that floods or stops reading cannot grow our memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Final

from websockets.asyncio.connection import Connection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.protocol import State

from codemode.protocol.v1.lanes import Lane
from codemode.transports.base import TextMessageReceived, TransportError, describe

__all__ = ["CLOSE_TIMEOUT", "WRITE_HIGH_WATER", "WebSocketTransport"]

#: Bytes buffered for writing on one socket above which :meth:`WebSocketTransport.drain` waits
#: (the ``write_limit`` both ends give the library).
WRITE_HIGH_WATER: Final = 1 << 20
#: How long a closing handshake may wait for the peer (both ends): a silent peer must not hold a
#: connection, and its sessions, long after its keepalive failed.
CLOSE_TIMEOUT: Final = 1.0

_END: Final = object()  # the socket ended cleanly


class _Socket:
    """One WebSocket's reader and writer."""

    def __init__(self, transport: WebSocketTransport, lane: Lane, connection: Connection) -> None:
        self.lane = lane
        self.connection = connection
        self.ready: deque[object] = deque()  # at most one message, or how the socket ended
        self.taken = asyncio.Event()
        self.failure: str | None = None
        self._transport = transport
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        connection = self.connection
        while True:
            try:
                message: object = await connection.recv()
            except ConnectionClosedOK:
                message = _END
            except ConnectionClosed as error:
                message = TransportError(_closed_detail(error))
            except Exception as error:
                message = TransportError(describe(error))
            if isinstance(message, str):
                message = TextMessageReceived("text message")
            self.ready.append(message)
            self._transport._wake()
            if not isinstance(message, bytes):
                return
            self.taken.clear()
            await self.taken.wait()  # the consumer took it: read the next one

    def send(self, frame: bytes | bytearray) -> None:
        # Written at once, in order, like a stream writer: the library's sans-I/O protocol frames
        # the message and the socket's transport buffers what the peer has not taken yet
        # (drain() bounds that).
        connection = self.connection
        if self.failure is None and connection.protocol.state is not State.OPEN:
            self.failure = "the WebSocket connection is closed"
        if self.failure is not None:
            raise TransportError(self.failure)
        connection.protocol.send_binary(frame)
        connection.send_data()

    async def drain(self) -> None:
        try:
            await self.connection.drain()
        except Exception as error:
            self.failure = self.failure or describe(error)
        if self.failure is not None:
            raise TransportError(self.failure)

    async def close(self) -> None:
        if self.failure is None:
            self.failure = "the WebSocket connection is closed"
        self.reader.cancel()
        with contextlib.suppress(Exception):
            await self.connection.close()
        with contextlib.suppress(BaseException):
            await self.reader


def _closed_detail(error: ConnectionClosed) -> str:
    frame = error.rcvd or error.sent
    if frame is not None and frame.reason:
        return f"WebSocket closed with code {frame.code}: {frame.reason}"
    if frame is not None:
        return f"WebSocket closed with code {frame.code}"
    return "WebSocket connection lost"


class WebSocketTransport:
    """A :class:`~codemode.transports.base.FrameTransport` over a control WebSocket, to which a
    bulk WebSocket may be attached (:meth:`attach_bulk`) once ``dual-websocket-v1`` was granted.

    Frames for the bulk lane written before the bulk socket is attached wait for it.
    """

    whole_frames = True

    def __init__(self, control: Connection) -> None:
        self._control = _Socket(self, Lane.CONTROL, control)
        self._bulk: _Socket | None = None
        self._early_bulk: list[bytes | bytearray] = []
        self._wakeup = asyncio.Event()
        self._closed = False

    @property
    def dual(self) -> bool:
        return self._bulk is not None

    @property
    def control(self) -> Connection:
        """The control socket."""
        return self._control.connection

    def attach_bulk(self, bulk: Connection) -> None:
        """Pair ``bulk`` as this connection's bulk socket."""
        if self._bulk is not None:
            raise RuntimeError("a bulk socket is already attached")
        if self._closed:
            raise TransportError("the WebSocket connection is closed")
        self._bulk = _Socket(self, Lane.BULK, bulk)
        early, self._early_bulk = self._early_bulk, []
        for frame in early:
            self._bulk.send(frame)

    async def bulk_closed(self) -> None:
        """Return once the bulk socket (if any) is closed."""
        if self._bulk is not None:
            await self._bulk.connection.wait_closed()

    def send(self, frame: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        if self._closed:
            raise TransportError("the WebSocket connection is closed")
        if lane is Lane.BULK:
            if self._bulk is None:
                self._early_bulk.append(frame)
                return
            self._bulk.send(frame)
        else:
            self._control.send(frame)

    async def drain(self) -> None:
        for socket in (self._control, self._bulk):
            if socket is not None:
                await socket.drain()

    def _wake(self) -> None:
        self._wakeup.set()

    async def receive(self) -> tuple[bytes, Lane] | None:
        while True:
            if self._closed:
                return None
            for socket in (self._control, self._bulk):
                if socket is not None and socket.ready:
                    return self._take(socket)
            self._wakeup.clear()
            await self._wakeup.wait()

    def _take(self, socket: _Socket) -> tuple[bytes, Lane] | None:
        message = socket.ready[0]
        if isinstance(message, bytes):
            socket.ready.popleft()
            socket.taken.set()
            return message, socket.lane
        # How the socket ended stays: closing either socket ends the connection.
        if isinstance(message, TransportError):
            raise message
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup.set()
        sockets = [s for s in (self._control, self._bulk) if s is not None]
        await asyncio.gather(*(socket.close() for socket in sockets), return_exceptions=True)
