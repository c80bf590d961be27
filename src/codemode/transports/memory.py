"""An in-memory transport pair for tests, with faults injectable per direction.

Each direction is a :class:`MemoryChannel` carrying a byte stream, so the receiving end splits
frames exactly as it would on a pipe. A channel can hold frames back, split them into small
chunks, drop them, inject raw bytes, fail the sender, or close (end of stream). Frames are never
reordered within a direction.
"""

from __future__ import annotations

import asyncio

from codemode.transports.base import TransportError
from codemode.transports.stream import StreamTransport

__all__ = ["MemoryChannel", "memory_pair"]


class MemoryChannel:
    """One direction of an in-memory pair (what one end writes, the other reads)."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self.frames_sent = 0
        self._held: list[bytes] | None = None
        self._drop = 0
        self._chunk: int | None = None
        self._failure: str | None = None
        self._closed = False

    # -- faults ------------------------------------------------------------------------------------

    def hold(self) -> None:
        """Queue frames instead of delivering them, until :meth:`release`."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Deliver every held frame, in order, and stop holding."""
        held, self._held = self._held or [], None
        for frame in held:
            self._deliver(frame)

    def drop(self, count: int = 1) -> None:
        """Silently lose the next ``count`` frames."""
        self._drop += count

    def split(self, size: int | None) -> None:
        """Deliver each frame in chunks of ``size`` bytes (``None``: whole)."""
        self._chunk = size

    def fail(self, message: str = "injected write failure") -> None:
        """Make every later send on this direction raise :class:`TransportError`."""
        self._failure = message

    def inject(self, data: bytes) -> None:
        """Deliver raw bytes (garbage, partial frames) to the receiver."""
        self.reader.feed_data(data)

    def close(self) -> None:
        """End the stream: the receiver sees end of stream after what was delivered."""
        if not self._closed:
            self._closed = True
            if self._held is None:
                self.reader.feed_eof()

    # -- the writing end ---------------------------------------------------------------------------

    def write(self, data: bytes | bytearray) -> None:
        if self._failure is not None:
            raise TransportError(self._failure)
        if self._closed:
            raise TransportError("the in-memory channel is closed")
        self.frames_sent += 1
        frame = bytes(data)
        if self._drop:
            self._drop -= 1
            return
        if self._held is not None:
            self._held.append(frame)
            return
        self._deliver(frame)

    def _deliver(self, frame: bytes) -> None:
        if self.reader.at_eof():
            return
        size = self._chunk or len(frame) or 1
        for start in range(0, len(frame), size):
            self.reader.feed_data(frame[start : start + size])
        if self._closed and self._held is None:
            self.reader.feed_eof()

    async def drain(self) -> None:
        if self._failure is not None:
            raise TransportError(self._failure)

    def is_closing(self) -> bool:
        return self._closed

    async def wait_closed(self) -> None:
        return None


def memory_pair() -> tuple[StreamTransport, StreamTransport, MemoryChannel, MemoryChannel]:
    """Two connected transports ``(a, b)`` and their channels ``a_to_b``, ``b_to_a``."""
    a_to_b, b_to_a = MemoryChannel(), MemoryChannel()
    return (
        StreamTransport(b_to_a.reader, a_to_b),
        StreamTransport(a_to_b.reader, b_to_a),
        a_to_b,
        b_to_a,
    )
