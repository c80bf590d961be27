"""The outside shape both V1 machines share: bytes or messages in, events and frames out.

Like websockets' ``Protocol(side)`` and h11's ``Connection(role)``, an endpoint never touches a
socket. Its glue feeds what arrived (:meth:`receive_data` for a byte stream, :meth:`receive_frame`
for one WebSocket message, :meth:`receive_eof` at the end of a stream), then takes
:meth:`events_received` to act on and :meth:`data_to_send` to write, each frame with the lane it
must travel on. Decoding, lane enforcement and the first-failure-wins end of the connection
happen here; what each message means is the subclass's business.

An endpoint whose decoder was made with ``apart_from`` does not decode a frame that large: it
hands the payload to its glue (:meth:`_large_frame`, an event of the subclass), and takes in
nothing more until the glue gives back the message, or the :class:`FrameError` its decode raised,
through :meth:`receive_decoded`. What arrives meanwhile is held, in order: frames are still
taken one after the other, and the glue can decode the large one on a worker thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

from codemode.errors import FrameError, LocalProtocolError, RemoteProtocolError
from codemode.protocol.v1.codec import (
    EOF,
    NEED_DATA,
    PREFIX_BYTES,
    DecodeApart,
    FrameDecoder,
    LargePayload,
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
        # The lane of a frame handed on to be decoded apart, until it comes back decoded; what
        # the peer sent since, each call in order.
        self._apart: Lane | None = None
        self._held_input: deque[Callable[[], None]] = deque()

    # -- input --------------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview, lane: Lane = Lane.CONTROL) -> None:
        """Bytes read from the byte stream of ``lane`` (any chunking)."""
        if self._ended:
            return
        if self._apart is not None:
            # The caller may reuse a mutable buffer.
            self._hold(self.receive_data, data if isinstance(data, bytes) else bytes(data), lane)
            return
        stream = self._streams[lane]
        stream.receive_data(data)
        self._drain_stream(stream, lane)

    def receive_eof(self, lane: Lane = Lane.CONTROL) -> None:
        """The stream of ``lane`` ended."""
        if self._ended or self._hold(self.receive_eof, lane):
            return
        stream = self._streams[lane]
        stream.receive_eof()
        self._drain_stream(stream, lane)

    def receive_frame(self, buffer: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        """One WebSocket binary message, which must hold exactly one frame (§6.4)."""
        if self._ended:
            return
        if self._apart is not None:
            self._hold(self.receive_frame, buffer, lane)
            return
        try:
            message = decode_framed(buffer, self._message_decoder)
        except FrameError as error:
            self._end(self._read_error(error.message))
            return
        except DecodeApart as apart:
            self._hand_on(apart.payload, lane)
            return
        self._take(message, lane)

    def receive(self, message: In, lane: Lane = Lane.CONTROL) -> None:
        """One decoded message that arrived on ``lane``."""
        if self._ended or self._hold(self.receive, message, lane):
            return
        self._take(message, lane)

    def receive_decoded(self, decoded: In | FrameError) -> None:
        """The frame handed on by :meth:`_large_frame`, decoded: its message, or the
        :class:`FrameError` its decode raised (:meth:`LargePayload.decode`). What arrived since
        is taken in after it (until another large frame is handed on)."""
        lane = self._apart
        if lane is None:
            raise LocalProtocolError("no frame is being decoded apart")
        self._apart = None
        if self._ended:
            self._held_input.clear()
            return
        if isinstance(decoded, FrameError):
            self._end(self._read_error(decoded.message))
            self._held_input.clear()
            return
        self._take(decoded, lane)
        self._drain_stream(self._streams[lane], lane)  # the frames read with it
        held = self._held_input
        while held and self._apart is None and not self._ended:
            held.popleft()()
        if self._ended:
            held.clear()

    @property
    def decoding_apart(self) -> bool:
        """True while a frame handed on to be decoded apart has not come back."""
        return self._apart is not None

    def _hold(self, method: Callable[..., None], *args: Any) -> bool:
        """While a frame is decoded apart, keep ``method(*args)`` for after it: True. Else False."""
        if self._apart is None:
            return False
        self._held_input.append(partial(method, *args))
        return True

    def _hand_on(self, payload: LargePayload[Any], lane: Lane) -> None:
        self._apart = lane
        self._large_frame(payload)

    def _take(self, message: In, lane: Lane) -> None:
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
            except DecodeApart as apart:  # the bytes after it stay in the stream
                self._hand_on(apart.payload, lane)
                return
            if message is NEED_DATA:
                return
            if message is EOF:
                self._end(self._end_of_stream())
                return
            self._take(message, lane)  # type: ignore[arg-type]

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
        (:func:`codemode.protocol.pieces.encode`), found them too large for a frame and kept
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

    def _large_frame(self, payload: LargePayload[Any]) -> None:
        """Hand ``payload`` to the glue (an event), which decodes it and gives back the result
        through :meth:`receive_decoded` (only with a decoder made with ``apart_from``)."""
        raise NotImplementedError

    def _end(self, reason: str | None) -> None:
        raise NotImplementedError

    def _read_error(self, detail: str) -> str:
        raise NotImplementedError

    def _wrong_lane(self, message_type: str, lane: str) -> str:
        raise NotImplementedError

    def _end_of_stream(self) -> str | None:
        raise NotImplementedError
