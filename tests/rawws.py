"""A minimal RFC 6455 WebSocket client over raw asyncio streams, for tests.

Written from scratch and independent of the ``websockets`` library, so that the host's WebSocket
side is checked against a second implementation: the HTTP/1.1 upgrade (``Sec-WebSocket-Key``, and
the ``Sec-WebSocket-Accept`` check), masked client frames with 7-, 16- and 64-bit lengths, binary,
text, close, ping and pong frames, fragmented messages, frames sent in part with the rest held
back (:meth:`RawWebSocket.send_partial`), and server frames read one by one or as messages.

Nothing here answers a ping on its own except :meth:`RawWebSocket.recv_message` (and only while
``auto_pong`` is true): a test that stops reading stops answering pings.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "Frame",
    "HTTPResponse",
    "HandshakeRejected",
    "HeldFrame",
    "Opcode",
    "RawWebSocket",
    "accept_for",
    "connect",
    "encode_frame",
    "http_get",
    "mask_payload",
]

#: The GUID of RFC 6455 §1.3, appended to the key to compute ``Sec-WebSocket-Accept``.
WEBSOCKET_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
DEFAULT_TIMEOUT: Final = 5.0


class Opcode(IntEnum):
    """Frame opcodes (RFC 6455 §5.2)."""

    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame read from the server (or a whole message from :meth:`RawWebSocket.recv_message`,
    whose payload is then the reassembled data and ``fin`` true)."""

    fin: bool
    opcode: int
    payload: bytes

    @property
    def close_code(self) -> int | None:
        """The status code of a close frame (``None``: none given, or not a close frame)."""
        if self.opcode != Opcode.CLOSE or len(self.payload) < 2:
            return None
        return int.from_bytes(self.payload[:2], "big")

    @property
    def close_reason(self) -> str:
        """The reason text of a close frame."""
        if self.opcode != Opcode.CLOSE:
            return ""
        return self.payload[2:].decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class HTTPResponse:
    """A plain HTTP response (header names lowercased)."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


class HandshakeRejected(Exception):
    """The server answered the upgrade with something other than ``101``."""

    def __init__(self, response: HTTPResponse) -> None:
        super().__init__(f"HTTP {response.status} {response.reason}: {response.body!r}")
        self.response = response

    @property
    def status(self) -> int:
        return self.response.status


def accept_for(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` value the server must send for ``key`` (RFC 6455 §4.2.2)."""
    digest = hashlib.sha1(key.encode("ascii") + WEBSOCKET_GUID).digest()
    return base64.b64encode(digest).decode("ascii")


def mask_payload(payload: bytes | bytearray | memoryview, key: bytes) -> bytes:
    """XOR ``payload`` with the 4-byte masking ``key`` (RFC 6455 §5.3); fast for large payloads."""
    if len(key) != 4:
        raise ValueError("a masking key has 4 bytes")
    size = len(payload)
    if size == 0:
        return b""
    repeated = (key * (size // 4 + 1))[:size]
    value = int.from_bytes(payload, "little") ^ int.from_bytes(repeated, "little")
    return value.to_bytes(size, "little")


def encode_frame(
    opcode: int,
    payload: bytes | bytearray = b"",
    *,
    fin: bool = True,
    rsv: int = 0,
    mask_key: bytes | None = None,
    masked: bool = True,
    declared_length: int | None = None,
) -> bytes:
    """One frame as a client writes it: masked (with a random key unless ``mask_key``), its length
    in the 7-, 16- or 64-bit form it needs. ``declared_length`` writes a length header that differs
    from the payload given (to send a frame's header without its payload)."""
    length = len(payload) if declared_length is None else declared_length
    first = (0x80 if fin else 0) | ((rsv & 0x7) << 4) | (opcode & 0xF)
    mask_bit = 0x80 if masked else 0
    if length < 126:
        header = struct.pack("!BB", first, mask_bit | length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", first, mask_bit | 126, length)
    else:
        header = struct.pack("!BBQ", first, mask_bit | 127, length)
    if not masked:
        return header + bytes(payload)
    key = os.urandom(4) if mask_key is None else mask_key
    return header + key + mask_payload(payload, key)


def _split_url(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme not in {"ws", "http"}:
        raise ValueError(f"{url}: only ws:// and http:// are supported")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return host, port, path


async def _open_stream(
    host: str, port: int, receive_buffer: int | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if receive_buffer is None:
        return await asyncio.open_connection(host, port)
    # SO_RCVBUF must be set before connecting: it bounds the window the peer may fill.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


def _request_bytes(host: str, port: int, path: str, headers: Iterable[tuple[str, str]]) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, status, *reason = status_line.split(" ", 2)
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {status_line!r}")
    headers: dict[str, str] = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(status), reason[0] if reason else "", headers


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    length = headers.get("content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    return await reader.read()


async def http_get(
    url: str,
    path: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> HTTPResponse:
    """A plain ``GET`` (no upgrade) of ``path`` (default: the URL's) on the server of ``url``."""
    host, port, url_path = _split_url(url)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(_request_bytes(host, port, path or url_path, headers))
            await writer.drain()
            status, reason, response_headers = await _read_head(reader)
            body = await _read_body(reader, response_headers)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    return HTTPResponse(status, reason, response_headers, body)


async def connect(
    url: str,
    headers: Iterable[tuple[str, str]] = (),
    *,
    timeout: float = DEFAULT_TIMEOUT,
    receive_buffer: int | None = None,
) -> RawWebSocket:
    """Open a WebSocket to ``url`` (``ws://HOST:PORT/PATH``) with extra request ``headers``.

    Raises :class:`HandshakeRejected` for any answer but ``101`` (with the response), and
    :class:`AssertionError` when a ``101`` is not a valid upgrade. ``receive_buffer`` sets
    ``SO_RCVBUF`` before connecting.
    """
    host, port, path = _split_url(url)
    key = base64.b64encode(os.urandom(16)).decode("ascii")
    upgrade = [
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", key),
        ("Sec-WebSocket-Version", "13"),
    ]
    async with asyncio.timeout(timeout):
        reader, writer = await _open_stream(host, port, receive_buffer)
        try:
            writer.write(_request_bytes(host, port, path, [*upgrade, *headers]))
            await writer.drain()
            status, reason, response_headers = await _read_head(reader)
            if status != 101:
                body = await _read_body(reader, response_headers)
                raise HandshakeRejected(HTTPResponse(status, reason, response_headers, body))
            assert response_headers.get("upgrade", "").lower() == "websocket", response_headers
            assert "upgrade" in response_headers.get("connection", "").lower(), response_headers
            assert response_headers.get("sec-websocket-accept") == accept_for(key), response_headers
            assert "sec-websocket-extensions" not in response_headers, response_headers
        except BaseException:
            writer.close()
            raise
    return RawWebSocket(reader, writer)


@dataclass
class HeldFrame:
    """A frame of which only the first ``sent`` bytes were written; :meth:`finish` writes the rest."""

    socket: RawWebSocket
    data: bytes
    sent: int
    finished: bool = field(default=False)

    @property
    def total(self) -> int:
        return len(self.data)

    async def finish(self) -> None:
        """Write the bytes held back."""
        if self.finished:
            raise RuntimeError("the frame was already finished")
        self.finished = True
        await self.socket.send_raw(memoryview(self.data)[self.sent :])


class RawWebSocket:
    """The client end of one WebSocket, driven frame by frame by the test."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        #: While true, :meth:`recv_message` answers pings with pongs.
        self.auto_pong = True
        #: The close frame the server sent, once one was read.
        self.close_received: Frame | None = None
        self.close_sent = False
        self._fragments: list[bytes] = []
        self._fragment_opcode: int | None = None

    # -- writing -------------------------------------------------------------------------------

    async def send_raw(self, data: bytes | bytearray | memoryview) -> None:
        """Write bytes as they are (part of a frame, garbage) and wait for the buffer to drain."""
        self.writer.write(data)
        await self.writer.drain()

    async def send_frame(
        self,
        opcode: int,
        payload: bytes | bytearray = b"",
        *,
        fin: bool = True,
        rsv: int = 0,
        mask_key: bytes | None = None,
    ) -> None:
        """Write one masked frame."""
        await self.send_raw(encode_frame(opcode, payload, fin=fin, rsv=rsv, mask_key=mask_key))

    async def send_binary(self, data: bytes | bytearray, *, fragments: int = 1) -> None:
        """Write one binary message, split into ``fragments`` frames (RFC 6455 §5.4)."""
        await self._send_message(Opcode.BINARY, bytes(data), fragments)

    async def send_text(self, text: str, *, fragments: int = 1) -> None:
        """Write one text message."""
        await self._send_message(Opcode.TEXT, text.encode("utf-8"), fragments)

    async def _send_message(self, opcode: Opcode, data: bytes, fragments: int) -> None:
        if fragments < 1:
            raise ValueError("a message has at least one fragment")
        step = max(1, -(-len(data) // fragments))
        pieces = [data[start : start + step] for start in range(0, len(data), step)] or [b""]
        frames = [
            encode_frame(
                opcode if index == 0 else Opcode.CONTINUATION,
                piece,
                fin=index == len(pieces) - 1,
            )
            for index, piece in enumerate(pieces)
        ]
        await self.send_raw(b"".join(frames))

    async def send_partial(self, opcode: int, payload: bytes | bytearray, sent: int) -> HeldFrame:
        """Write the first ``sent`` bytes of a frame carrying ``payload`` and hold the rest."""
        data = encode_frame(opcode, payload)
        if not 0 <= sent < len(data):
            raise ValueError(f"sent must be below the frame's {len(data)} bytes")
        await self.send_raw(memoryview(data)[:sent])
        return HeldFrame(self, data, sent)

    async def ping(self, payload: bytes = b"") -> None:
        await self.send_frame(Opcode.PING, payload)

    async def pong(self, payload: bytes = b"") -> None:
        await self.send_frame(Opcode.PONG, payload)

    async def send_close(self, code: int | None = 1000, reason: str = "") -> None:
        """Write a close frame (once)."""
        if self.close_sent:
            return
        self.close_sent = True
        payload = b"" if code is None else code.to_bytes(2, "big") + reason.encode("utf-8")
        with contextlib.suppress(ConnectionError):
            await self.send_frame(Opcode.CLOSE, payload)

    # -- reading -------------------------------------------------------------------------------

    async def recv_frame(self, timeout: float | None = DEFAULT_TIMEOUT) -> Frame | None:
        """The next frame as the server sent it; ``None`` when the TCP stream ended."""
        async with asyncio.timeout(timeout):
            try:
                head = await self.reader.readexactly(2)
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
            first, second = head
            assert second & 0x80 == 0, "a server must not mask its frames"
            assert first & 0x70 == 0, f"unexpected RSV bits in {first:#x}"
            length = second & 0x7F
            if length == 126:
                length = int.from_bytes(await self.reader.readexactly(2), "big")
            elif length == 127:
                length = int.from_bytes(await self.reader.readexactly(8), "big")
            payload = await self.reader.readexactly(length) if length else b""
        return Frame(bool(first & 0x80), first & 0x0F, payload)

    async def recv_message(self, timeout: float | None = DEFAULT_TIMEOUT) -> Frame | None:
        """The next whole data message (fragments joined), or the server's close frame (which is
        answered, and the TCP connection closed); pings are answered while ``auto_pong``, pongs
        skipped. ``None`` at the end of the TCP stream."""
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.recv_frame(None)
                if frame is None:
                    return None
                opcode = frame.opcode
                if opcode == Opcode.PING:
                    if self.auto_pong:
                        with contextlib.suppress(ConnectionError):
                            await self.pong(frame.payload)
                    continue
                if opcode == Opcode.PONG:
                    continue
                if opcode == Opcode.CLOSE:
                    # Answer it, then drop the TCP connection: the closing handshake is over.
                    self.close_received = frame
                    await self.send_close(frame.close_code)
                    self.writer.close()
                    return frame
                if opcode == Opcode.CONTINUATION:
                    assert self._fragment_opcode is not None, "a continuation without a start"
                    self._fragments.append(frame.payload)
                else:
                    assert self._fragment_opcode is None, "a new message inside a fragmented one"
                    self._fragment_opcode = opcode
                    self._fragments = [frame.payload]
                if frame.fin:
                    start, self._fragment_opcode = self._fragment_opcode, None
                    data, self._fragments = b"".join(self._fragments), []
                    return Frame(True, start, data)

    async def wait_closed(self, timeout: float | None = DEFAULT_TIMEOUT) -> Frame | None:
        """Read (discarding data messages) until the server closes: its close frame, or ``None``
        when the TCP stream ended without one. Fails the test after ``timeout``."""
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.recv_message(None)
                if frame is None or frame.opcode == Opcode.CLOSE:
                    return frame

    async def close(self, code: int = 1000, timeout: float = 1.0) -> None:
        """The closing handshake (bounded by ``timeout``), then the TCP connection."""
        try:
            if self.close_received is None:
                await self.send_close(code)
                with contextlib.suppress(TimeoutError, AssertionError, ConnectionError):
                    await self.wait_closed(timeout)
        finally:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()

    def abort(self) -> None:
        """Drop the TCP connection at once (buffered bytes are discarded)."""
        self.writer.transport.abort()
