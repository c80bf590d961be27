"""The outside shape both V1 machines share: bytes or messages in, events and frames out.

Like websockets' ``Protocol(side)`` and h11's ``Connection(role)``, an endpoint never touches a
socket. Its glue feeds what arrived (:meth:`receive_data` for a byte stream, :meth:`receive_frame`
for one WebSocket message, :meth:`receive_eof` at the end of a stream), then takes
:meth:`events_received` to act on and :meth:`data_to_send` to write, each frame with the lane it
must travel on. Decoding, lane enforcement and the first-failure-wins end of the connection
happen here; what each message means is the subclass's business.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from codemode.errors import FrameError, RemoteProtocolError
from codemode.protocol.v1.codec import (
    EOF,
    NEED_DATA,
    PREFIX_BYTES,
    FrameDecoder,
    MessageDecoder,
    decode_framed,
    encode_frame,
    oversize_error,
)
from codemode.protocol.v1.lanes import Lane, lane_of
from codemode.protocol.v1.messages import ClientToHost, HostToClient, message_type

__all__ = ["Endpoint"]

In = TypeVar("In", bound=ClientToHost | HostToClient)
Out = TypeVar("Out", bound=ClientToHost | HostToClient)
E = TypeVar("E")


class Endpoint(Generic[In, Out, E]):
    """Frames in and out of one V1 connection; subclasses decide what messages mean.

    Subclasses implement :meth:`_message` (raise :class:`RemoteProtocolError` for a peer's
    violation), :meth:`_end` (record the first failure and queue its consequences) and the texts
    of :meth:`_read_error`, :meth:`_wrong_lane` and :meth:`_end_of_stream`.
    """

    def __init__(self, decoder: MessageDecoder[In]) -> None:
        self._message_decoder: MessageDecoder[In] = decoder
        self._streams: dict[Lane, FrameDecoder[In]] = {lane: FrameDecoder(decoder) for lane in Lane}
        self._outgoing: list[tuple[bytes | bytearray, Lane]] = []
        self._events: list[E] = []
        self._dual = False
        self._ended = False

    # -- input --------------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview, lane: Lane = Lane.CONTROL) -> None:
        """Bytes read from the byte stream of ``lane`` (any chunking)."""
        if self._ended:
            return
        stream = self._streams[lane]
        stream.receive_data(data)
        self._drain_stream(stream, lane)

    def receive_eof(self, lane: Lane = Lane.CONTROL) -> None:
        """The stream of ``lane`` ended."""
        if self._ended:
            return
        stream = self._streams[lane]
        stream.receive_eof()
        self._drain_stream(stream, lane)

    def receive_frame(self, buffer: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        """One WebSocket binary message, which must hold exactly one frame (§6.4)."""
        if self._ended:
            return
        try:
            message = decode_framed(buffer, self._message_decoder)
        except FrameError as error:
            self._end(self._read_error(error.message))
            return
        self.receive(message, lane)

    def receive(self, message: In, lane: Lane = Lane.CONTROL) -> None:
        """One decoded message that arrived on ``lane``."""
        if self._ended:
            return
        try:
            if self._dual and lane_of(message) is not lane:
                raise RemoteProtocolError(self._wrong_lane(message_type(message), lane.value))
            self._message(message)
        except RemoteProtocolError as error:
            self._end(error.message)

    def _drain_stream(self, stream: FrameDecoder[In], lane: Lane) -> None:
        while not self._ended:
            try:
                message = stream.next_message()
            except FrameError as error:
                self._end(self._read_error(error.message))
                return
            if message is NEED_DATA:
                return
            if message is EOF:
                self._end(self._end_of_stream())
                return
            self.receive(message, lane)  # type: ignore[arg-type]

    # -- output -------------------------------------------------------------------------------

    def events_received(self) -> list[E]:
        """What happened since the last call, in order."""
        events, self._events = self._events, []
        return events

    def data_to_send(self) -> list[tuple[bytes | bytearray, Lane]]:
        """Frames to write since the last call, in order, each with its lane (single-socket
        carriers write every frame on their one socket)."""
        outgoing, self._outgoing = self._outgoing, []
        return outgoing

    @property
    def ended(self) -> bool:
        """True once the connection is over (nothing more is received or produced)."""
        return self._ended

    def _encode(self, message: Out, excess: int = 0) -> tuple[bytes | bytearray, Lane]:
        """``message`` as a frame and the lane it goes on; raises :class:`FrameError` when it
        cannot be written (nothing is queued then).

        ``excess``: the bytes the message lacks. The glue measured some of its values elsewhere
        (:func:`codemode.runtime.pieces.encode`), found them too large for a frame and kept
        none of them; each stands in as a shorter ``msgspec.Raw``. The frame is then refused
        with the length it would have had."""
        frame = encode_frame(message)
        if excess:
            raise oversize_error(len(frame) - PREFIX_BYTES + excess)
        return frame, lane_of(message) if self._dual else Lane.CONTROL

    def _queue(self, message: Out, excess: int = 0) -> None:
        """Encode ``message`` and queue it (see :meth:`_encode`)."""
        self._write(self._encode(message, excess))

    def _write(self, frame: tuple[bytes | bytearray, Lane]) -> None:
        """Queue an encoded frame; once the connection ended nothing more is written."""
        if not self._ended:
            self._outgoing.append(frame)

    def _emit(self, event: E) -> None:
        self._events.append(event)

    # -- what the glue reports ----------------------------------------------------------------

    def read_failed(self, detail: str) -> None:
        """Reading from the peer failed; ``detail`` says how."""
        raise NotImplementedError

    def write_failed(self, detail: str) -> None:
        """Writing to the peer failed; ``detail`` says how."""
        raise NotImplementedError

    def text_received(self) -> None:
        """The peer sent a text WebSocket message (only binary frames are allowed)."""
        raise NotImplementedError

    # -- subclass hooks -------------------------------------------------------------------------

    def _message(self, message: In) -> None:
        raise NotImplementedError

    def _end(self, reason: str | None) -> None:
        raise NotImplementedError

    def _read_error(self, detail: str) -> str:
        raise NotImplementedError

    def _wrong_lane(self, message_type: str, lane: str) -> str:
        raise NotImplementedError

    def _end_of_stream(self) -> str | None:
        raise NotImplementedError
