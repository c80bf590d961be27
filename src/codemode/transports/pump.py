"""Moves bytes between one transport and one sans-I/O V1 machine: the whole of the glue's I/O.

A :class:`Pump` feeds what its transport reads into the machine (as a byte stream or as whole
WebSocket frames), writes what the machine queued on the lane it names, reports read and write
failures to the machine, and hands the machine's events to its owner. It decides nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from codemode.protocol.v1.endpoint import Endpoint
from codemode.protocol.v1.lanes import Lane
from codemode.transports.base import (
    FrameTransport,
    PushingTransport,
    TextMessageReceived,
    TransportError,
    describe,
)

__all__ = ["Pump"]

E = TypeVar("E")


class Pump(Generic[E]):
    """Drive ``protocol`` over ``transport``; every event goes to ``apply``."""

    def __init__(
        self,
        transport: FrameTransport,
        protocol: Endpoint[Any, Any, E],
        apply: Callable[[E], object],
    ) -> None:
        self.transport = transport
        self.protocol = protocol
        self._apply = apply
        self._flushing = False
        self._paused = False  # reading paused by pause(), and receive() not yet back since
        # A transport that pushes its reads (a pipe of our own) feeds the machine in the loop
        # iteration that read them; receive() then only reports the end, or a pause.
        self._pushing = transport if isinstance(transport, PushingTransport) else None
        if self._pushing is not None and self._pushing.pushes:
            self._pushing.push_to(self._pushed)

    def _pushed(self, data: bytes, lane: Lane) -> None:
        protocol = self.protocol
        if self.transport.whole_frames:  # a message that is not exactly one frame ends it
            protocol.receive_frame(data, lane)
        else:
            protocol.receive_data(data, lane)
        self.flush()
        if protocol.ended and self._pushing is not None:
            self._pushing.pause_reading()  # receive() returns

    async def receive(self) -> bool:
        """Read once and feed the machine; False at the end of the stream, which the caller
        reports (``receive_eof()``, or why it ended) before the next :meth:`flush`. Over a
        pushing transport, reads feed the machine as they arrive and this returns at the end,
        or when reading paused (the caller drains, then calls again to resume)."""
        protocol, transport = self.protocol, self.transport
        try:
            item = await transport.receive()
        except TextMessageReceived:
            protocol.text_received()
        except (TransportError, OSError) as error:
            protocol.read_failed(describe(error))
        else:
            paused, self._paused = self._paused, False
            if item is None:
                return paused  # after pause(), not the end: a real end is read again next time
            data, lane = item
            if transport.whole_frames:
                protocol.receive_frame(data, lane)
            elif data:  # a pushing transport returns nothing when it paused for back-pressure
                protocol.receive_data(data, lane)
        self.flush()
        return True

    def pause(self) -> None:
        """Read nothing more for now: a pushing transport stops reading, and the pending
        :meth:`receive` returns (True); the next one reads again. The caller waits in between
        (the machine takes nothing in while a frame is decoded apart)."""
        if self._pushing is not None and self._pushing.pushes:
            self._paused = True
            self._pushing.pause_reading()

    async def drain(self) -> None:
        """Wait until the transport took what was written (a failure ends the connection)."""
        if self.protocol.ended:
            return
        try:
            await self.transport.drain()
        except (TransportError, OSError) as error:
            self.protocol.write_failed(describe(error))
            self.flush()

    def flush(self) -> None:
        """Write what the machine queued and apply its events, until it has nothing more.

        Re-entrant calls (an event whose handling makes the machine produce more) return at
        once: the running flush picks up what they produced.
        """
        if self._flushing:
            return
        self._flushing = True
        protocol, transport = self.protocol, self.transport
        try:
            while True:
                frames = protocol.data_to_send()
                if len(frames) > 1 and not transport.whole_frames:
                    frames = _joined(frames)  # one write instead of one per frame
                for frame, lane in frames:
                    try:
                        transport.send(frame, lane)
                    except (TransportError, OSError) as error:
                        protocol.write_failed(describe(error))
                        break
                events = protocol.events_received()
                if not events:
                    return  # applying no event queued nothing new
                for event in events:
                    self._apply(event)
        finally:
            self._flushing = False


#: Frames queued together are written as one chunk up to this size (larger ones go alone: a
#: copy of them would cost more than the write it saves).
_JOIN_LIMIT: Final = 1 << 16


def _joined(frames: list[tuple[bytes | bytearray, Lane]]) -> list[tuple[bytes | bytearray, Lane]]:
    """Consecutive small frames of one lane as one chunk each (a byte stream carries them the
    same way), so that what one flush queued takes one write."""
    out: list[tuple[bytes | bytearray, Lane]] = []
    run: list[bytes | bytearray] = []
    size = 0
    run_lane = Lane.CONTROL
    for frame, lane in frames:
        if run and (lane is not run_lane or size + len(frame) > _JOIN_LIMIT):
            out.append((b"".join(run) if len(run) > 1 else run[0], run_lane))
            run, size = [], 0
        run.append(frame)
        run_lane = lane
        size += len(frame)
    if run:
        out.append((b"".join(run) if len(run) > 1 else run[0], run_lane))
    return out
