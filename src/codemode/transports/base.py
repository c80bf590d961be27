"""The carrier interface shared by stdio, child processes, WebSockets and in-memory pairs."""

from __future__ import annotations

from typing import Protocol

from codemode.errors import CodeModeError
from codemode.protocol.v1.lanes import Lane

__all__ = ["FrameTransport", "TransportError"]


class TransportError(CodeModeError):
    """Reading or writing the underlying channel failed (the message says how)."""


class FrameTransport(Protocol):
    """Moves whole V1 frames (4-byte little-endian length prefix + payload).

    ``dual`` carriers have a control and a bulk lane; single carriers use ``Lane.CONTROL`` only.
    """

    @property
    def dual(self) -> bool:
        """True when the carrier has separate control and bulk lanes."""
        ...

    def send(self, frame: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        """Queue one complete frame for writing (frames never interleave).

        Raises :class:`TransportError` when the channel is closed or broken.
        """
        ...

    async def drain(self) -> None:
        """Wait until queued frames were handed to the channel (back-pressure)."""
        ...

    async def receive(self) -> tuple[bytes, Lane] | None:
        """The next frame's payload and the lane it came on; ``None`` at a clean end of stream.

        Raises :class:`~codemode.errors.FrameError` for framing errors and
        :class:`TransportError` when the channel breaks.
        """
        ...

    async def close(self) -> None:
        """Close both directions; pending :meth:`receive` calls return ``None``."""
        ...
