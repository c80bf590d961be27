"""V1 frames over WebSocket: one socket, or a control + bulk pair (``protocol-v1.md`` §6.4, §7).

Every binary message carries exactly one frame; the transport never looks inside beyond its
length prefix. Messages are *pushed*: both ends open their sockets as :class:`PushClientConnection`
/ :class:`PushServerConnection` (the library's connections, given through its ``create_connection``
parameter), which hand every whole data message to the transport from the socket's
``data_received`` — no reader task, no wake-up in between — and the transport feeds it to the sink
its consumer registered (:meth:`WebSocketTransport.push_to`, the :class:`~codemode.transports.pump.Pump`).
:meth:`WebSocketTransport.receive` returns what did not go to the sink (messages that arrived
before it was registered) and reports how the connection ended; either way the consumer checks
that a message is exactly one frame (``receive_frame``).

Frames are written at once, in order; what waits to be written is bounded by
:meth:`WebSocketTransport.drain`. With ``pause_while_backlogged`` (the host) the transport stops
reading both sockets after a message that left a socket's writes above their high-water mark, and
reads again once they fell below the low-water mark, so a peer that floods or stops reading
cannot grow our memory. See ``docs/decisions/0015-websocket-push.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.frames import OK_CLOSE_CODES, Close, CloseCode, Frame, Opcode
from websockets.protocol import Event, State

from codemode.protocol.v1.lanes import Lane
from codemode.transports.base import TextMessageReceived, TransportError, describe

__all__ = [
    "CLOSE_TIMEOUT",
    "WRITE_HIGH_WATER",
    "PushClientConnection",
    "PushServerConnection",
    "WebSocketTransport",
]

#: Bytes buffered for writing on one socket above which :meth:`WebSocketTransport.drain` waits
#: (the ``write_limit`` both ends give the library), and the host stops reading.
WRITE_HIGH_WATER: Final = 1 << 20
#: How long a closing handshake may wait for the peer (both ends): a silent peer must not hold a
#: connection, and its sessions, long after its keepalive failed.
CLOSE_TIMEOUT: Final = 1.0

#: What a pushed message goes to: ``sink(frame, lane)``, in the iteration that read it.
Sink = Callable[[bytes, Lane], None]

#: Empty fragments one message may have. The size limit bounds the others (each brings at least
#: a byte), but not these: an endless message of empty frames would never end. Any number of
#: non-empty fragments is taken (Go's gorilla/websocket sends one frame per 4 KiB).
_MAX_EMPTY_FRAGMENTS: Final = 4096


class _Pushing(Connection):
    """What both pushing connections add to the library's: each whole data message goes to the
    :class:`_Socket` that claimed the connection (none is queued in the library's ``recv()``
    assembler), or waits for one with reading paused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._socket: _Socket | None = None
        self._waiting: list[tuple[bytes, bool]] = []  # (message, is text) before a claim
        # The message being assembled, one buffer whatever its fragments: memory stays within
        # the message size limit the library enforces (a list of fragments cost ~40 bytes more
        # per fragment, so it needed a count limit, which refused 16 MiB in 4 KiB frames).
        self._partial: bytearray | None = None
        self._empty_fragments = 0
        self._text = False
        self._reading = True
        self._lost = False

    # -- the library's hooks ---------------------------------------------------------------------

    def process_event(self, event: Event) -> None:
        if isinstance(event, Frame) and event.opcode in _DATA:
            self._data_frame(event)
        else:  # the handshake, pings, pongs, close frames: as the library does
            super().process_event(event)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        socket = self._socket
        if socket is None:
            return
        if self.protocol.state is not State.OPEN:
            # A close frame came, or the library failed the connection (a protocol error, an
            # oversize message): the connection ends now, not when the peer closes TCP, which a
            # peer that goes silent never does.
            socket.closing()
        elif socket.backlogged():
            # The library answers pings itself, writing as it reads: a peer that floods pings
            # and never reads must back up our reading too, not our memory.
            socket.writable()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._lost = True
        self._partial = None
        if self._socket is not None:
            self._socket.lost()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._socket is not None:
            self._socket.writable()

    # -- ours ------------------------------------------------------------------------------------

    def _data_frame(self, frame: Frame) -> None:
        data = frame.data
        if frame.opcode is not Opcode.CONT:
            self._text = frame.opcode is Opcode.TEXT
        partial = self._partial
        if frame.fin and partial is None:
            message = data if type(data) is bytes else bytes(data)
        else:
            if partial is None:
                partial = self._partial = bytearray()
                self._empty_fragments = 0
            if not data:
                self._empty_fragments += 1
                if self._empty_fragments > _MAX_EMPTY_FRAGMENTS:
                    self._partial = None
                    self.protocol.fail(CloseCode.MESSAGE_TOO_BIG, "too many empty fragments")
                    self.send_data()
                    return
            partial += data
            if not frame.fin:
                return
            message = bytes(partial)
            self._partial = None
        socket = self._socket
        if socket is None:
            self._waiting.append((message, self._text))
            self.set_reading(False)  # until a transport claims this connection
        else:
            socket.message(message, self._text)

    def claim(self, socket: _Socket) -> None:
        """Hand every later message to ``socket``, and the ones that waited now."""
        self._socket = socket
        waiting, self._waiting = self._waiting, []
        for message, text in waiting:
            socket.message(message, text)
        if self._lost:
            socket.lost()
        elif self.protocol.state is State.CLOSING:
            socket.closing()

    def set_reading(self, reading: bool) -> None:
        """Pause or resume reading the socket (back-pressure); idempotent."""
        if reading is self._reading or self._lost:
            return
        self._reading = reading
        if reading:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()


_DATA: Final = frozenset((Opcode.TEXT, Opcode.BINARY, Opcode.CONT))


class PushClientConnection(_Pushing, ClientConnection):
    """A client connection whose messages a :class:`WebSocketTransport` receives by push (give it
    to :func:`websockets.asyncio.client.connect` as ``create_connection``)."""


class PushServerConnection(_Pushing, ServerConnection):
    """A server connection whose messages a :class:`WebSocketTransport` receives by push (give it
    to :func:`websockets.asyncio.server.serve` as ``create_connection``)."""


class _Socket:
    """One WebSocket of a transport: its lane, writer and how it ended."""

    def __init__(self, transport: WebSocketTransport, lane: Lane, connection: _Pushing) -> None:
        self.lane = lane
        self.connection = connection
        self.failure: str | None = None
        self._transport = transport

    def message(self, data: bytes, text: bool) -> None:
        self._transport._message(self.lane, data, text)

    def lost(self) -> None:
        self._transport._lost(self)

    def closing(self) -> None:
        self._transport._closing(self)

    def writable(self) -> None:
        self._transport._update_reading()

    def backlogged(self) -> bool:
        transport = self.connection.transport
        return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]

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
        with contextlib.suppress(Exception):
            await self.connection.close()


def _closed_detail(error: ConnectionClosed) -> str:
    return _close_frame_detail(error.rcvd or error.sent)


def _close_frame_detail(frame: Close | None) -> str:
    if frame is not None and frame.reason:
        return f"WebSocket closed with code {frame.code}: {frame.reason}"
    if frame is not None:
        return f"WebSocket closed with code {frame.code}"
    return "WebSocket connection lost"


class WebSocketTransport:
    """A :class:`~codemode.transports.base.FrameTransport` over a control WebSocket, to which a
    bulk WebSocket may be attached (:meth:`attach_bulk`) once ``dual-websocket-v1`` was granted.

    Both must be :class:`PushClientConnection` or :class:`PushServerConnection`. Frames for the
    bulk lane written before the bulk socket is attached wait for it. ``pause_while_backlogged``:
    stop reading while our writes back up (the host; a client must go on reading, or two ends
    with full buffers could each wait for the other).
    """

    whole_frames = True
    pushes = True

    def __init__(self, control: Connection, *, pause_while_backlogged: bool = True) -> None:
        self._pause_while_backlogged = pause_while_backlogged
        self._sink: Sink | None = None
        self._queue: deque[tuple[bytes, Lane]] = deque()  # what receive() returns next
        self._ended = False
        self._failure: BaseException | None = None
        self._stopped = False  # the consumer paused reading
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._early_bulk: list[bytes | bytearray] = []
        self._bulk: _Socket | None = None
        self._control = _Socket(self, Lane.CONTROL, _pushing(control))
        self._control.connection.claim(self._control)

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
        socket = self._bulk = _Socket(self, Lane.BULK, _pushing(bulk))
        early, self._early_bulk = self._early_bulk, []
        for frame in early:
            socket.send(frame)
        socket.connection.claim(socket)
        self._update_reading()

    async def bulk_closed(self) -> None:
        """Return once the bulk socket (if any) is closed."""
        if self._bulk is not None:
            await self._bulk.connection.wait_closed()

    def _sockets(self) -> tuple[_Socket, ...]:
        bulk = self._bulk
        return (self._control,) if bulk is None else (self._control, bulk)

    # -- writing -----------------------------------------------------------------------------------

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
        for socket in self._sockets():
            await socket.drain()

    def backlogged(self) -> bool:
        return any(socket.backlogged() for socket in self._sockets())

    # -- reading -----------------------------------------------------------------------------------

    def push_to(self, sink: Sink) -> None:
        """Hand every later message to ``sink(frame, lane)`` as it arrives (what arrived before
        comes out of :meth:`receive`). A sink that raises ends the connection with that error,
        which :meth:`receive` raises."""
        self._sink = sink

    def pause_reading(self) -> None:
        """The consumer is done for now (its machine ended): stop reading both sockets and let
        the pending :meth:`receive` return ``None``; the next :meth:`receive` reads again.

        Back-pressure needs no call: the transport pauses and resumes by itself (see the class).
        """
        if not self._stopped and not self._ended:
            self._stopped = True
            self._update_reading()
            self._wake()

    async def receive(self) -> tuple[bytes, Lane] | None:
        if self._stopped:
            self._stopped = False
            self._update_reading()
        while True:
            if self._closed:
                return None
            queue = self._queue
            if queue:
                item = queue.popleft()
                if not queue:
                    self._update_reading()
                return item
            if self._ended:
                failure = self._failure
                if failure is None:
                    return None
                raise failure
            if self._stopped:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _message(self, lane: Lane, data: bytes, text: bool) -> None:
        if self._ended or self._closed:
            return
        if text:
            self._end(TextMessageReceived("text message"))
            return
        sink = self._sink
        if sink is None or self._queue:
            self._queue.append((data, lane))  # for receive(), in order
            self._update_reading()
            self._wake()
            return
        try:
            sink(data, lane)
        except BaseException as error:  # a bug in the consumer: the connection ends with it
            self._end(error)
            if not isinstance(error, Exception):
                raise
            return
        if self._pause_while_backlogged:
            self._update_reading()  # the peer does not take what we write: read no more for now

    def _lost(self, socket: _Socket) -> None:
        # How either socket ended ends the connection (the first end wins).
        error = socket.connection.close_exc
        self._end(
            None if isinstance(error, ConnectionClosedOK) else TransportError(_closed_detail(error))
        )

    def _closing(self, socket: _Socket) -> None:
        # The closing handshake began on either socket: the connection ends (the first end wins)
        # cleanly if the peer closed it with an ordinary code, else with how it was closed.
        protocol = socket.connection.protocol
        received = protocol.close_rcvd
        if received is not None and received.code in OK_CLOSE_CODES:
            self._end(None)
        else:
            self._end(TransportError(_close_frame_detail(received or protocol.close_sent)))

    def _end(self, failure: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._failure = failure
            self._update_reading()
        self._wake()

    def _update_reading(self) -> None:
        """Read while nothing waits for receive() and our writes do not back up; always while
        closing (the closing handshake needs the peer's close frame)."""
        sockets = self._sockets()
        reading = self._closed or not (
            self._ended
            or self._stopped
            or self._queue
            or (self._pause_while_backlogged and any(s.backlogged() for s in sockets))
        )
        for socket in sockets:
            socket.connection.set_reading(reading)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._update_reading()
        self._wake()
        sockets = self._sockets()
        await asyncio.gather(*(socket.close() for socket in sockets), return_exceptions=True)


def _pushing(connection: Connection) -> _Pushing:
    if not isinstance(connection, _Pushing):
        raise TypeError(
            "a WebSocketTransport needs a PushClientConnection or PushServerConnection "
            "(pass it to connect() / serve() as create_connection)"
        )
    return connection
