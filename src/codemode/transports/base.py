"""The carrier interface shared by stdio, child processes, WebSockets and in-memory pairs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from codemode.errors import CodeModeError
from codemode.protocol.v1.lanes import Lane

__all__ = [
    "FrameTransport",
    "PushingTransport",
    "TextMessageReceived",
    "TransportError",
    "describe",
]


def describe(error: BaseException) -> str:
    """The detail of an I/O failure as it goes into a protocol text (its message, or its type)."""
    return str(error) or type(error).__name__


class TransportError(CodeModeError):
    """Reading or writing the underlying channel failed (the message says how)."""


class TextMessageReceived(TransportError):
    """The peer sent a text WebSocket message where only binary frames are allowed."""


class FrameTransport(Protocol):
    """Moves V1 bytes between two peers and never looks inside them.

    A byte-stream carrier (``whole_frames`` false) returns reads as they come, in any chunking;
    a message carrier (WebSocket, ``whole_frames`` true) returns one binary message per read,
    which must hold exactly one frame. ``dual`` carriers have a control and a bulk lane; single
    carriers use ``Lane.CONTROL`` only.
    """

    @property
    def dual(self) -> bool:
        """True when the carrier has separate control and bulk lanes."""
        ...

    @property
    def whole_frames(self) -> bool:
        """True when every read is one whole frame (a WebSocket message)."""
        ...

    def send(self, frame: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        """Queue one complete frame for writing (frames never interleave).

        Raises :class:`TransportError` when the channel is closed or broken.
        """
        ...

    async def drain(self) -> None:
        """Wait until queued frames were handed to the channel (back-pressure)."""
        ...

    def backlogged(self) -> bool:
        """True while the peer has not taken what was sent, past the carrier's high-water mark
        (:meth:`drain` would wait)."""
        ...

    async def receive(self) -> tuple[bytes, Lane] | None:
        """The next bytes read and the lane they came on; ``None`` at a clean end of stream.

        Raises :class:`TransportError` when the channel breaks.
        """
        ...

    async def close(self) -> None:
        """Close both directions; pending :meth:`receive` calls return ``None``."""
        ...


@runtime_checkable
class PushingTransport(Protocol):
    """A carrier that can hand its reads (bytes, or a WebSocket's one-frame messages) to a sink in
    the loop iteration that read them (when :attr:`pushes` is true), instead of returning them
    from ``receive()``."""

    @property
    def pushes(self) -> bool:
        """True when reads go to the sink given to :meth:`push_to`."""
        ...

    def push_to(self, sink: Callable[[bytes, Lane], None]) -> None:
        """Hand every later read to ``sink(data, lane)`` as it arrives."""
        ...

    def pause_reading(self) -> None:
        """Stop reading (back-pressure) and let the pending ``receive()`` return; the next
        ``receive()`` resumes reading."""
        ...
