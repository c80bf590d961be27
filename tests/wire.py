"""Raw V1 frames for tests: what a hand-written peer writes and reads, without the machines.

:func:`frame` makes one frame of a message (or of any payload bytes, valid or not);
:class:`FrameReader` takes whole frames off an :class:`asyncio.StreamReader` (a child's stdout, one
direction of ``memory_pair()``) however the bytes are chunked; :func:`payloads` splits a complete
capture and :func:`read_payload_blocking` reads a blocking stream (a scripted host's stdin).
:class:`RawClient` and :class:`RawHost` are the two hand-driven ends of an in-memory pair, each
with its side of the handshake (:func:`raw_client`, :func:`raw_host`).
"""

from __future__ import annotations

import asyncio
from typing import IO, Any, Final, Generic, TypeVar

from codemode.protocol.constants import SESSION_RESOURCE_LIMITS_CAPABILITY
from codemode.protocol.v1.codec import MessageDecoder, encode_frame
from codemode.protocol.v1.messages import (
    UNSET,
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    ExecutionStarted,
    HostToClient,
    OperationRequest,
    OperationResponse,
    SessionExecute,
    SessionOpen,
    SessionReady,
    UnsetType,
    WireExecuteRequest,
    WireOk,
    WireToolDefinition,
)
from codemode.transports import MemoryChannel, StreamTransport, memory_pair

__all__ = [
    "CLIENT_MESSAGES",
    "HELLO",
    "HOST_MESSAGES",
    "READY",
    "FrameReader",
    "RawClient",
    "RawHost",
    "RawPeer",
    "frame",
    "hello",
    "payloads",
    "raw_client",
    "raw_host",
    "read_payload_blocking",
    "ready",
]

M = TypeVar("M")
In = TypeVar("In", ClientToHost, HostToClient)
Out = TypeVar("Out", ClientToHost, HostToClient)

_PREFIX: Final = 4
_CHUNK: Final = 1 << 16

#: Decodes what a client writes / what a host writes.
CLIENT_MESSAGES: Final = MessageDecoder[ClientToHost](ClientToHost)
HOST_MESSAGES: Final = MessageDecoder[HostToClient](HostToClient)


def hello(
    optional: tuple[str, ...] = (SESSION_RESOURCE_LIMITS_CAPABILITY,),
    required: tuple[str, ...] = (),
    versions: tuple[int, ...] = (1,),
) -> ConnectionHello:
    """A ``connection/hello`` (by default the one this project's client sends)."""
    return ConnectionHello(versions, required, optional)


def ready(
    capabilities: tuple[str, ...] = (SESSION_RESOURCE_LIMITS_CAPABILITY,),
    token: str | UnsetType = UNSET,
) -> ConnectionReady:
    """A ``connection/ready`` granting ``capabilities`` (and a bulk token for dual carriers)."""
    return ConnectionReady(1, capabilities, token)


HELLO: Final = hello()
READY: Final = ready()


def frame(message: Any) -> bytes:
    """One frame: a message (or any JSON value) encoded canonically, or payload bytes prefixed
    with their length as they are (garbage and oversize payloads included)."""
    if isinstance(message, bytes | bytearray):
        return len(message).to_bytes(_PREFIX, "little") + bytes(message)
    return bytes(encode_frame(message))


def _take(buffer: bytearray) -> bytes | None:
    """Remove the first whole frame from ``buffer`` and return its payload (``None``: not yet)."""
    if len(buffer) < _PREFIX:
        return None
    end = _PREFIX + int.from_bytes(buffer[:_PREFIX], "little")
    if len(buffer) < end:
        return None
    payload = bytes(buffer[_PREFIX:end])
    del buffer[:end]
    return payload


def payloads(data: bytes | bytearray) -> list[bytes]:
    """The payloads of a capture that holds whole frames only."""
    buffer = bytearray(data)
    found = []
    while (payload := _take(buffer)) is not None:
        found.append(payload)
    assert not buffer, f"the capture ends inside a frame: {bytes(buffer[:64])!r}"
    return found


def read_payload_blocking(stream: IO[bytes]) -> bytes | None:
    """The next frame's payload from a blocking stream; ``None`` at its end."""
    prefix = stream.read(_PREFIX)
    if len(prefix) < _PREFIX:
        return None
    return stream.read(int.from_bytes(prefix, "little"))


class FrameReader:
    """Whole frames off a byte stream, in whatever chunks the bytes come.

    Bytes already read stay buffered here, so a read that times out loses nothing.
    """

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = bytearray()

    async def read(self, timeout: float | None = None) -> bytes | None:
        """The next frame's payload; ``None`` at an end of stream between frames."""
        async with asyncio.timeout(timeout):
            while (payload := _take(self._buffer)) is None:
                chunk = await self._reader.read(_CHUNK)
                if not chunk:
                    assert not self._buffer, (
                        f"the stream ended inside a frame: {bytes(self._buffer[:64])!r}"
                    )
                    return None
                self._buffer += chunk
        return payload

    async def payload(self, timeout: float | None = None) -> bytes:
        """The next frame's payload (the stream must not end first)."""
        payload = await self.read(timeout)
        assert payload is not None, "the peer closed the connection"
        return payload

    async def message(self, decoder: MessageDecoder[M], timeout: float | None = None) -> M:
        """The next frame, decoded (the stream must not end first)."""
        return decoder.decode(await self.payload(timeout))

    async def rest(self, timeout: float | None = None) -> bytes:
        """Every byte not read as a frame yet, up to the end of the stream."""
        async with asyncio.timeout(timeout):
            rest = bytes(self._buffer) + await self._reader.read()
        self._buffer.clear()
        return rest


class RawPeer(Generic[In, Out]):
    """One end of ``memory_pair()`` driven by the test: it writes frames (or raw bytes) and reads
    whole frames. ``to_host`` and ``to_client`` are the pair's channels, for fault injection."""

    #: How long a read may take before the test fails / how long ``nothing()`` listens.
    timeout: float = 5.0
    quiet: float = 0.2

    def __init__(
        self,
        to_host: MemoryChannel,
        to_client: MemoryChannel,
        *,
        outgoing: MemoryChannel,
        incoming: MemoryChannel,
        decoder: MessageDecoder[In],
    ) -> None:
        self.to_host = to_host
        self.to_client = to_client
        self.outgoing = outgoing
        self._decoder: MessageDecoder[In] = decoder
        self.frames = FrameReader(incoming.reader)

    def send(self, *messages: Out) -> None:
        """Write whole frames to the peer."""
        for message in messages:
            self.outgoing.write(frame(message))

    def inject(self, data: bytes) -> None:
        """Raw bytes for the peer's reader (garbage, partial frames)."""
        self.outgoing.inject(data)

    def close(self) -> None:
        """End the stream this end writes (the peer sees end of stream)."""
        self.outgoing.close()

    async def receive_raw(self, timeout: float | None = None) -> bytes | None:
        """The next frame's payload, or ``None`` when the peer closed its side."""
        return await self.frames.read(self.timeout if timeout is None else timeout)

    async def receive(self, timeout: float | None = None) -> In:
        """The next message (fails the test after ``timeout``)."""
        return await self.frames.message(
            self._decoder, self.timeout if timeout is None else timeout
        )

    async def receive_until(self, last: In, limit: int = 2000) -> list[In]:
        """Messages up to and including ``last``."""
        messages: list[In] = []
        while len(messages) < limit:
            messages.append(await self.receive())
            if messages[-1] == last:
                return messages
        raise AssertionError(f"{last!r} did not arrive: {messages[-5:]!r}")

    async def expect_end(self, timeout: float | None = None) -> None:
        """The peer closes its side without writing anything more."""
        payload = await self.receive_raw(timeout)
        assert payload is None, f"unexpected frame {payload!r}"

    async def nothing(self, delay: float | None = None) -> None:
        """Assert that the peer writes no frame (and does not close) for ``delay`` seconds."""
        try:
            payload = await self.frames.read(self.quiet if delay is None else delay)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected {payload!r}")


class RawClient(RawPeer[HostToClient, ClientToHost]):
    """The client end of an in-memory pair, written by hand."""

    def __init__(self, to_host: MemoryChannel, to_client: MemoryChannel) -> None:
        super().__init__(
            to_host, to_client, outgoing=to_host, incoming=to_client, decoder=HOST_MESSAGES
        )

    async def handshake(self, first: ClientToHost = HELLO, reply: HostToClient = READY) -> None:
        """Send ``first`` (our client's hello) and expect ``reply``."""
        self.send(first)
        assert await self.receive() == reply

    async def open(self, request_id: int = 1, session: str = "session-1") -> None:
        """Open ``session`` (``session/open`` answered ``session/ready``)."""
        self.send(OperationRequest(request_id, SessionOpen(session)))
        assert await self.receive() == OperationResponse(request_id, WireOk(SessionReady(session)))

    async def execute(
        self,
        request_id: int,
        source: str,
        *,
        tools: tuple[WireToolDefinition, ...] = (),
        yield_ms: int | None = 10_000,
        session: str = "session-1",
    ) -> str:
        """Start a cell; returns its id (after ``execution/started``)."""
        body = WireExecuteRequest("call-1", list(tools), source, yield_ms, None)
        self.send(OperationRequest(request_id, SessionExecute(session, body)))
        reply = await self.receive()
        assert isinstance(reply, OperationResponse) and reply.id == request_id, reply
        assert isinstance(reply.result, WireOk), reply
        assert isinstance(reply.result.value, ExecutionStarted), reply
        return reply.result.value.cell_id


class RawHost(RawPeer[ClientToHost, HostToClient]):
    """The host end of an in-memory pair, written by hand."""

    timeout = 2.0
    quiet = 0.05

    def __init__(self, to_host: MemoryChannel, to_client: MemoryChannel) -> None:
        super().__init__(
            to_host, to_client, outgoing=to_client, incoming=to_host, decoder=CLIENT_MESSAGES
        )

    async def handshake(self, capabilities: tuple[str, ...] = ()) -> ConnectionHello:
        """Read the client's hello and grant ``capabilities``; returns the hello."""
        first = await self.receive()
        assert isinstance(first, ConnectionHello), first
        self.send(ready(capabilities))
        return first


def raw_client() -> tuple[StreamTransport, RawClient]:
    """A host's transport and the raw client at its other end."""
    _, host_end, to_host, to_client = memory_pair()
    return host_end, RawClient(to_host, to_client)


def raw_host() -> tuple[StreamTransport, RawHost]:
    """A client's transport and the raw host at its other end."""
    client_end, _, to_host, to_client = memory_pair()
    return client_end, RawHost(to_host, to_client)
