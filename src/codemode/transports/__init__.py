"""Carriers of V1 bytes: they move frames and never interpret them.

:class:`FrameTransport` is the one interface; :class:`StreamTransport` serves every byte stream
(a process's stdio, a child's pipes, the in-memory pair used by tests); :class:`Pump` moves bytes
between a transport and a V1 machine.
"""

from codemode.transports.base import FrameTransport, TransportError
from codemode.transports.memory import MemoryChannel, memory_pair
from codemode.transports.pump import Pump
from codemode.transports.stream import StreamTransport, stdio_transport

__all__ = [
    "FrameTransport",
    "MemoryChannel",
    "Pump",
    "StreamTransport",
    "TransportError",
    "memory_pair",
    "stdio_transport",
]
