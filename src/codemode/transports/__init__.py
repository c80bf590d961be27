"""Carriers of V1 frames: they move whole frames and never interpret them.

:class:`FrameTransport` is the one interface; :class:`StreamTransport` serves every byte stream
(a process's stdio, a child's pipes, the in-memory pair used by tests).
"""

from codemode.transports.base import FrameTransport, TransportError
from codemode.transports.memory import MemoryChannel, memory_pair
from codemode.transports.stream import StreamTransport, stdio_transport

__all__ = [
    "FrameTransport",
    "MemoryChannel",
    "StreamTransport",
    "TransportError",
    "memory_pair",
    "stdio_transport",
]
