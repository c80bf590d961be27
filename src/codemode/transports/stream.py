"""Frames over a byte stream: a process's stdio, a child's pipes, an in-memory pair."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from typing import Final, Protocol

from codemode.protocol.v1.lanes import Lane
from codemode.transports.base import TransportError, describe

__all__ = ["ByteWriter", "StreamTransport", "stdio_streams", "stdio_transport"]

_READ_CHUNK: Final = 1 << 16


class ByteWriter(Protocol):
    """The part of :class:`asyncio.StreamWriter` a stream transport uses."""

    def write(self, data: bytes | bytearray) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...
    def is_closing(self) -> bool: ...
    async def wait_closed(self) -> None: ...


class StreamTransport:
    """A single-lane :class:`~codemode.transports.base.FrameTransport` over a byte stream."""

    dual = False
    whole_frames = False

    def __init__(self, reader: asyncio.StreamReader, writer: ByteWriter | None) -> None:
        self._reader = reader
        self._writer = writer
        self._closed = False

    def send(self, frame: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        writer = self._writer
        if self._closed or writer is None or writer.is_closing():
            raise TransportError("the stream is closed")
        try:
            writer.write(frame)
        except (OSError, RuntimeError) as error:
            raise TransportError(describe(error)) from None

    async def drain(self) -> None:
        writer = self._writer
        if writer is None or self._closed:
            raise TransportError("the stream is closed")
        try:
            await writer.drain()
        except (OSError, RuntimeError) as error:
            raise TransportError(describe(error)) from None

    async def receive(self) -> tuple[bytes, Lane] | None:
        if self._closed:
            return None
        try:
            chunk = await self._reader.read(_READ_CHUNK)
        except (OSError, RuntimeError) as error:
            raise TransportError(describe(error)) from None
        if not chunk or self._closed:
            return None
        return chunk, Lane.CONTROL

    async def close(self) -> None:
        self._closed = True
        if not self._reader.at_eof():
            self._reader.feed_eof()  # wake a pending receive()
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.close()
            with contextlib.suppress(OSError, RuntimeError):
                await writer.wait_closed()


class _BlockingWriter:
    """Writes to a file descriptor that asyncio cannot watch (a regular file)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._closed = False

    def write(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self._closed = True

    def is_closing(self) -> bool:
        return self._closed

    async def wait_closed(self) -> None:
        return None


def _watchable(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


async def _pump_file(fd: int, reader: asyncio.StreamReader) -> None:
    # A regular file on stdin: read it in a thread (asyncio only watches pipes and sockets).
    while chunk := await asyncio.to_thread(os.read, fd, _READ_CHUNK):
        reader.feed_data(chunk)
    reader.feed_eof()


async def stdio_transport() -> StreamTransport:
    """This process's stdin/stdout as a frame transport (stdout then carries frames only)."""
    return StreamTransport(*await stdio_streams())


async def stdio_streams() -> tuple[asyncio.StreamReader, ByteWriter]:
    """This process's stdin and stdout as byte streams (stdout then carries only what is
    written here): a pipe, socket or terminal is watched by the loop, a regular file is read
    and written in a thread."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    if _watchable(stdin):
        pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdin, "rb", 0, closefd=False)
        )
        pipe.max_size = _READ_CHUNK  # type: ignore[attr-defined]
    else:
        task = asyncio.ensure_future(_pump_file(stdin, reader))
        _PUMPS.add(task)
        task.add_done_callback(_PUMPS.discard)
    writer: ByteWriter
    if _watchable(stdout):
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(stdout, "wb", 0, closefd=False)
        )
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    else:
        writer = _BlockingWriter(stdout)
    return reader, writer


_PUMPS: set[asyncio.Task[None]] = set()
