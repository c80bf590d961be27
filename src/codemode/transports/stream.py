"""Frames over a byte stream: a process's stdio, a child's pipes, an in-memory pair.

A :class:`StreamTransport` reads in one of two ways. Over an :class:`asyncio.StreamReader` its
consumer pulls each chunk with :meth:`~StreamTransport.receive` (a task wakes per read). Over a
pipe it owns (:func:`stdio_transport`, :func:`pipe_transport`) it *pushes*: a consumer that
registered a sink with :meth:`~StreamTransport.push_to` gets every chunk in the loop iteration
that read it, inside the pipe's ``data_received`` — no reader task, no wake-up in between; its
:meth:`~StreamTransport.receive` then only reports the end of the stream, a failure, or a pause
for back-pressure (the sink asked for it, :meth:`~StreamTransport.pause_reading`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from collections.abc import Callable
from typing import IO, Final, Protocol, cast

from codemode.protocol.v1.lanes import Lane
from codemode.transports.base import TransportError, describe

__all__ = ["ByteWriter", "StreamTransport", "pipe_transport", "stdio_streams", "stdio_transport"]

#: One read's size: asyncio's pipes default to 256 KiB, which the allocator serves with
#: mmap/munmap per read (≈15 µs on the development VM against ≈1 µs for 64 KiB).
_READ_CHUNK: Final = 1 << 16

#: What a pushed chunk goes to: ``sink(data, lane)``, in the iteration that read it.
Sink = Callable[[bytes, Lane], None]


class ByteWriter(Protocol):
    """The part of :class:`asyncio.StreamWriter` a stream transport uses."""

    def write(self, data: bytes | bytearray) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...
    def is_closing(self) -> bool: ...
    async def wait_closed(self) -> None: ...


class StreamTransport:
    """A single-lane :class:`~codemode.transports.base.FrameTransport` over a byte stream.

    ``reader`` is an :class:`asyncio.StreamReader` to pull from, or ``None`` for a transport
    whose input is pushed by a :class:`_PipeInput` (see :func:`pipe_transport`).
    """

    dual = False
    whole_frames = False

    def __init__(
        self,
        reader: asyncio.StreamReader | None,
        writer: ByteWriter | None,
        *,
        pause_while_backlogged: bool = True,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._closed = False
        self._pause_while_backlogged = pause_while_backlogged
        # Push mode (reader is None): the pipe's transport, the consumer's sink, what arrived
        # before it registered one, and how (and whether) the stream ended.
        self._input: asyncio.ReadTransport | None = None
        self._sink: Sink | None = None
        self._early: list[bytes] = []
        self._ended = False
        self._failure: BaseException | None = None
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def pushes(self) -> bool:
        """True when reads are pushed to a sink (:meth:`push_to`) rather than pulled."""
        return self._reader is None

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
        if self._reader is None:
            return await self._receive_pushed()
        try:
            chunk = await self._reader.read(_READ_CHUNK)
        except (OSError, RuntimeError) as error:
            raise TransportError(describe(error)) from None
        if not chunk or self._closed:
            return None
        return chunk, Lane.CONTROL

    # -- push mode ---------------------------------------------------------------------------------

    def push_to(self, sink: Sink) -> None:
        """Hand every later read to ``sink`` as it arrives (push mode only; what arrived before
        comes out of the next :meth:`receive`). A sink that raises ends the stream with that
        error, which :meth:`receive` raises."""
        if self._reader is not None:
            raise RuntimeError("this stream transport is read by pulling (receive())")
        self._sink = sink

    def pause_reading(self) -> None:
        """Stop reading (back-pressure) and let the pending :meth:`receive` return an empty chunk;
        the next :meth:`receive` resumes reading."""
        if self._input is not None and not self._paused and not self._ended:
            self._paused = True
            self._input.pause_reading()
            self._wake()

    async def _receive_pushed(self) -> tuple[bytes, Lane] | None:
        if self._paused:
            self._paused = False
            if self._input is not None and not self._ended:
                self._input.resume_reading()
        while True:
            if self._early:  # read before a sink took over (or with none: pulled, then)
                data = b"".join(self._early)
                self._early.clear()
                return data, Lane.CONTROL
            if self._ended or self._closed or self._paused:
                break
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._paused and not self._ended and not self._closed:
            return b"", Lane.CONTROL
        failure = self._failure
        if failure is not None and not self._closed:
            if isinstance(failure, OSError | TransportError):
                raise TransportError(describe(failure))
            raise failure
        return None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pushed(self, data: bytes) -> None:
        sink = self._sink
        if self._closed or self._ended:
            return
        if sink is None or self._early:  # no sink yet, or older bytes still wait for receive()
            self._early.append(data)
            self._wake()
            return
        try:
            sink(data, Lane.CONTROL)
        except BaseException as error:  # a bug in the consumer: the stream ends with it
            self._end(error)
            if self._input is not None:
                self._input.close()
            if not isinstance(error, Exception):
                raise
            return
        if self._pause_while_backlogged and self.backlogged():
            self.pause_reading()  # the peer does not take what we write: read no more for now

    def unsent(self) -> int:
        """Bytes sent here and not yet written to the peer (still queued, even after
        :meth:`close`, which lets them drain); 0 when the writer does not tell."""
        transport: asyncio.WriteTransport | None = getattr(self._writer, "transport", None)
        if transport is None:
            return 0
        return transport.get_write_buffer_size()

    def backlogged(self) -> bool:
        """True while the writer holds more than its high-water mark (never for a writer that
        does not tell)."""
        # Duck-typed: uvloop's transports are not subclasses of asyncio's.
        transport: asyncio.WriteTransport | None = getattr(self._writer, "transport", None)
        if transport is None:
            return False
        return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]

    def _end(self, failure: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._failure = failure
        self._wake()

    async def close(self) -> None:
        self._closed = True
        if self._reader is not None and not self._reader.at_eof():
            self._reader.feed_eof()  # wake a pending receive()
        if self._input is not None:
            self._input.close()
        self._wake()
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.close()
            with contextlib.suppress(OSError, RuntimeError):
                await writer.wait_closed()


class _PipeInput(asyncio.Protocol):
    """A pipe read straight into a push-mode :class:`StreamTransport`."""

    def __init__(self, owner: StreamTransport) -> None:
        self._owner = owner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._owner._input = cast(asyncio.ReadTransport, transport)  # uvloop's: no subclass

    def data_received(self, data: bytes) -> None:
        self._owner._pushed(data)

    def eof_received(self) -> None:
        self._owner._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._end(exc)


async def pipe_transport(
    read_pipe: IO[bytes], writer: ByteWriter | None, *, pause_while_backlogged: bool = True
) -> StreamTransport:
    """A push-mode transport reading ``read_pipe`` (a pipe, socket or terminal the loop can
    watch) and writing to ``writer``.

    With ``pause_while_backlogged`` (the host's side) it stops reading after a chunk that left
    ``writer`` above its high-water mark, until the consumer's next ``receive()``; only one end
    of a connection may do that (the client's reads must go on, or both ends could wait for the
    other to read)."""
    transport = StreamTransport(None, writer, pause_while_backlogged=pause_while_backlogged)
    pipe, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: _PipeInput(transport), read_pipe
    )
    if hasattr(pipe, "max_size"):  # asyncio's pipe transport; uvloop has no such knob
        pipe.max_size = _READ_CHUNK
    return transport


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
    # Of character devices only terminals: epoll refuses /dev/null (asyncio then never reads it,
    # uvloop's libuv aborts the process).
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))


async def _pump_file(fd: int, reader: asyncio.StreamReader) -> None:
    # A regular file on stdin: read it in a thread (asyncio only watches pipes and sockets).
    while chunk := await asyncio.to_thread(os.read, fd, _READ_CHUNK):
        reader.feed_data(chunk)
    reader.feed_eof()


async def stdio_transport() -> StreamTransport:
    """This process's stdin/stdout as a frame transport (stdout then carries frames only).

    A stdin the loop can watch is read in push mode (:func:`pipe_transport`); a regular file is
    read in a thread and pulled."""
    stdin = sys.stdin.fileno()
    if not _watchable(stdin):
        return StreamTransport(*await stdio_streams())
    return await pipe_transport(os.fdopen(stdin, "rb", 0, closefd=False), await _stdout_writer())


async def stdio_streams() -> tuple[asyncio.StreamReader, ByteWriter]:
    """This process's stdin and stdout as byte streams (stdout then carries only what is
    written here): a pipe, socket or terminal is watched by the loop, a regular file is read
    and written in a thread."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    stdin = sys.stdin.fileno()
    if _watchable(stdin):
        pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdin, "rb", 0, closefd=False)
        )
        if hasattr(pipe, "max_size"):  # asyncio's pipe transport; uvloop has no such knob
            pipe.max_size = _READ_CHUNK
    else:
        task = asyncio.ensure_future(_pump_file(stdin, reader))
        _PUMPS.add(task)
        task.add_done_callback(_PUMPS.discard)
    return reader, await _stdout_writer(reader)


async def _stdout_writer(reader: asyncio.StreamReader | None = None) -> ByteWriter:
    loop = asyncio.get_running_loop()
    stdout = sys.stdout.fileno()
    if not _watchable(stdout):
        return _BlockingWriter(stdout)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(stdout, "wb", 0, closefd=False)
    )
    return asyncio.StreamWriter(transport, protocol, reader, loop)


_PUMPS: set[asyncio.Task[None]] = set()
