"""The V1 frame codec (``protocol-v1.md`` §2.1, §6): sans-I/O, bytes in, messages out.

A frame is a 4-byte little-endian payload length followed by one strict JSON text. The
:class:`FrameDecoder` takes bytes in any chunking and returns whole messages; nothing here reads or
writes a stream. Payloads are decoded straight out of the receive buffer (no copy per frame), and an
oversize length is refused from the prefix alone, before any payload is buffered.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any, Final, Generic, Protocol, TypeVar

import msgspec

from codemode.errors import FrameError, FrameErrorKind
from codemode.protocol import pieces
from codemode.protocol.constants import MAX_FRAME_BYTES
from codemode.protocol.strict_json import (
    LARGE_PAYLOAD_BYTES,
    JSONError,
    check_no_duplicate_keys,
    collector_paused,
    decode_error_detail,
    loads_large,
)
from codemode.protocol.v1.messages import BLANK_IDENTIFIER_ERROR, IDENTIFIER_MUST_NOT_BE_EMPTY
from codemode.protocol.v1.revision import WireRevision, check_revision

__all__ = [
    "EOF",
    "LARGE_FRAME_BYTES",
    "NEED_DATA",
    "PREFIX_BYTES",
    "UPSTREAM_MAX_NESTING",
    "DecodeApart",
    "FrameDecoder",
    "LargePayload",
    "MessageDecoder",
    "PayloadDecoder",
    "RawPayloads",
    "decode_framed",
    "encode_frame",
    "encode_payload",
    "into_framed_bytes",
    "oversize_error",
]

M = TypeVar("M")
M_co = TypeVar("M_co", covariant=True)

#: The bytes of a frame's length prefix.
PREFIX_BYTES: Final = 4
_PREFIX: Final = PREFIX_BYTES
_ENCODER: Final = msgspec.json.Encoder()
_ANY_DECODER: Final = msgspec.json.Decoder()
_DECODE_PREFIX: Final = "failed to decode code-mode IPC frame: "
_ENCODE_PREFIX: Final = "failed to encode code-mode IPC frame: "
_TOO_DEEP: Final = _DECODE_PREFIX + "recursion limit exceeded"
#: The deepest nesting of arrays and objects the upstream host reads in a frame (serde_json's
#: recursion limit, 128, refuses the 128th level); ``MessageDecoder(max_depth=...)``.
UPSTREAM_MAX_NESTING: Final = 127
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_BRACKETS_OR_QUOTES: Final = bytes(b for b in range(256) if b not in b'[]{}"')
_SQUARE: Final = bytes.maketrans(b"{}", b"[]")
_RUNS: Final = re.compile(rb"\[+|\]+")
# A large payload with fewer commas than one per this many bytes holds few values.
_FEW_VALUES: Final = 32
#: A payload this large may hold a long string literal: a host decodes such a client frame off
#: its event loop (``MessageDecoder(apart_from=...)``).
LARGE_FRAME_BYTES: Final = pieces.LONG


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: Returned by :meth:`FrameDecoder.next_message` when more bytes are needed.
NEED_DATA: Final = _Sentinel("NEED_DATA")
#: Returned by :meth:`FrameDecoder.next_message` after a clean end of stream.
EOF: Final = _Sentinel("EOF")


def oversize_error(length: int, limit: int = MAX_FRAME_BYTES) -> FrameError:
    """The error of a frame whose payload is ``length`` bytes, more than ``limit``."""
    return FrameError(
        FrameErrorKind.OVERSIZE, f"code-mode IPC frame length {length} exceeds {limit} bytes"
    )


def _validation_detail(error: msgspec.ValidationError) -> str:
    return str(error).replace(BLANK_IDENTIFIER_ERROR, IDENTIFIER_MUST_NOT_BE_EMPTY)


def _nesting_exceeds(payload: bytes | bytearray, limit: int) -> bool:
    """True when the valid JSON text ``payload`` nests arrays and objects more than ``limit``
    deep. Each step is a C-speed pass over bytes, or one Python step per run of brackets when
    there are at most an eighth as many runs as brackets."""
    if len(payload.translate(None, _NOT_BRACKETS)) <= limit:
        return False  # brackets inside strings count too, so this never misses
    # Escaped quotes out first (`\"` is no quote), then what strings hold. Escapes pair left to
    # right, as bytes.replace scans: escaped backslashes go first, then every `\"` left is an
    # escaped quote (two C passes; a regex substitution took 2.7 s for 30 M escapes).
    plain = payload.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in payload else payload
    # Two quotes side by side are an empty string or two strings with nothing between them:
    # dropping them leaves what lies outside strings as it was, and most strings then go whole.
    marks = plain.translate(None, _NOT_BRACKETS_OR_QUOTES).replace(b'""', b"")
    brackets = b"".join(marks.split(b'"')[::2]) if b'"' in marks else marks
    brackets = brackets.translate(_SQUARE)
    # Taking away every empty pair takes one level off the deepest nesting. Wide texts (many
    # small values) shrink to a few brackets in a pass or two; the passes stop when one takes
    # away less than an eighth, which leaves at most an eighth as many runs as brackets.
    peeled = 0
    while brackets and len(brackets) // 2 + peeled > limit:
        fewer = brackets.replace(b"[]", b"")
        if len(brackets) - len(fewer) < len(brackets) // 8:
            break
        brackets, peeled = fewer, peeled + 1
    if len(brackets) // 2 + peeled <= limit:
        return False
    if not brackets:
        return True
    # Runs alternate, an opening one first: the deepest point ends some opening run.
    steps = list(map(len, _RUNS.findall(brackets)))
    steps[1::2] = [-step for step in steps[1::2]]
    return max(accumulate(steps)) + peeled > limit


class MessageDecoder(Generic[M]):
    """Decodes one payload as wire type ``M`` (or any JSON value) under the strict rules.

    Raises :class:`FrameError` with kind ``invalid_json`` when the text is not strict JSON and
    ``invalid_message`` when it is JSON but not a valid ``M``. Runtime response bodies must have
    the shape of ``revision`` (default: V1 as pinned, no timing fields). With ``max_depth``,
    arrays and objects nested deeper than that are ``invalid_json`` (``recursion limit
    exceeded``), as upstream's reader refuses them; nesting too deep for the parser itself is
    refused so in any case.
    """

    __slots__ = ("_apart_from", "_decoder", "_max_depth", "_revision", "_type", "_typed")

    def __init__(
        self,
        wire_type: Any = Any,
        revision: WireRevision = WireRevision.PINNED,
        *,
        max_depth: int | None = None,
        apart_from: int | None = None,
    ) -> None:
        self._type = wire_type
        self._typed = wire_type is not Any
        self._revision = WireRevision(revision)
        self._max_depth = max_depth
        self._apart_from = apart_from
        self._decoder: msgspec.json.Decoder[M] = msgspec.json.Decoder(wire_type)

    def decode(self, data: bytes | bytearray, start: int = 0, end: int | None = None) -> M:
        """Decode ``data[start:end]``. A decoder made with ``apart_from`` raises
        :class:`DecodeApart` for a payload of that many bytes or more, instead of decoding it."""
        try:
            return self._decode(data, start, end)
        except RecursionError:
            raise FrameError(FrameErrorKind.INVALID_JSON, _TOO_DEEP) from None

    def _decode(self, data: bytes | bytearray, start: int, end: int | None) -> M:
        if end is None and start == 0 and type(data) is bytes:
            if len(data) < LARGE_PAYLOAD_BYTES:
                return self._decode_msgspec(data)
            stop = len(data)
        else:
            stop = len(data) if end is None else end
            if stop - start < LARGE_PAYLOAD_BYTES:
                # Copying a small payload is cheaper than exporting a view of it.
                return self._decode_msgspec(data[start:stop])
        if self._apart_from is not None and stop - start >= self._apart_from:
            raise DecodeApart(LargePayload(self, data, start, stop))
        return self._decode_large_payload(data, start, stop)

    def _decode_large_payload(self, data: bytes | bytearray, start: int, stop: int) -> M:
        if start == 0 and stop == len(data) and type(data) is bytes:
            payload: bytes | bytearray = data
        else:
            payload = bytes(memoryview(data)[start:stop])
        if not self._typed or payload.count(b",") < len(payload) // _FEW_VALUES:
            # Few values (mostly long strings): jiter's parse and a conversion of those few
            # objects beat a typed decode followed by a re-encoding for the duplicate-key check.
            return self._decode_large(bytes(payload))
        # Many values: a typed decode makes only the message's own objects (a generic parse and
        # a conversion took 4-6 times as long for a frame of many small values).
        with collector_paused():
            return self._decode_msgspec(payload)

    def _decode_msgspec(self, payload: bytes | bytearray) -> M:
        try:
            message = self._decoder.decode(payload)
        except msgspec.ValidationError as error:
            if self._typed:
                # Bad JSON (e.g. 1e400) or a bad message? Decide on the plain value.
                _check_json(payload)
                raise FrameError(
                    FrameErrorKind.INVALID_MESSAGE, _DECODE_PREFIX + _validation_detail(error)
                ) from None
            raise FrameError(FrameErrorKind.INVALID_JSON, _DECODE_PREFIX + str(error)) from None
        except msgspec.DecodeError as error:
            detail = decode_error_detail(error, payload)
            raise FrameError(FrameErrorKind.INVALID_JSON, _DECODE_PREFIX + detail) from None
        # A payload that is byte for byte the canonical encoding of what it decoded to cannot
        # repeat a key (the encoder never does); canonical peers always take this exit.
        encoded = _ENCODER.encode(message)
        if encoded != payload:
            try:
                check_no_duplicate_keys(payload, message, encoded)
            except JSONError as error:
                raise FrameError(FrameErrorKind.INVALID_JSON, _DECODE_PREFIX + str(error)) from None
        self._check_depth(payload)
        return self._check_revision(message)

    def _check_depth(self, payload: bytes | bytearray) -> None:
        if self._max_depth is not None and _nesting_exceeds(payload, self._max_depth):
            raise FrameError(FrameErrorKind.INVALID_JSON, _TOO_DEEP)

    @property
    def revision(self) -> WireRevision:
        """The wire revision runtime responses must have."""
        return self._revision

    def _check_revision(self, message: M) -> M:
        if self._typed:
            detail = check_revision(message, self._revision)
            if detail is not None:
                raise FrameError(FrameErrorKind.INVALID_MESSAGE, _DECODE_PREFIX + detail)
        return message

    def decode_apart(self, data: bytes | bytearray, start: int = 0, end: int | None = None) -> M:
        """Decode ``data[start:end]`` as :meth:`decode` does, with the same result or the same
        :class:`FrameError`, but never in one long C call where that can be helped: the long
        string literals (:data:`codemode.protocol.pieces.LONG` bytes or more) are decoded a piece
        at a time. Pure (for a worker thread, where the event loop gets the GIL between the
        pieces); ``data[start:end]`` must not change meanwhile. A payload the pieces do not fit
        (many values, no long literal, anything that fails) is decoded whole, as :meth:`decode`
        decodes it."""
        stop = len(data) if end is None else end
        try:
            message = self._in_pieces(data, start, stop)
        except Exception:  # whatever is wrong with it, the whole decode says it in its words
            message = None
        if message is not None:
            return message
        try:
            if stop - start < LARGE_PAYLOAD_BYTES:  # (an ``apart_from`` below it)
                return self._decode_msgspec(data[start:stop])
            return self._decode_large_payload(data, start, stop)
        except RecursionError:
            raise FrameError(FrameErrorKind.INVALID_JSON, _TOO_DEEP) from None

    def _in_pieces(self, data: bytes | bytearray, start: int, stop: int) -> M | None:
        """What :meth:`_decode_large` gives for ``data[start:stop]``, its long literals decoded a
        piece at a time; ``None`` when the whole decode would take the typed path (many values)
        or there is no long literal. Raises whatever goes wrong."""
        PIECE = pieces.PIECE
        if self._typed:
            # The whole decode's choice, made on the same count (a count per piece).
            commas = sum(
                data.count(b",", at, min(at + PIECE, stop)) for at in range(start, stop, PIECE)
            )
            if commas >= (stop - start) // _FEW_VALUES:
                return None
        parts = pieces.split(data, start, stop)
        if not parts.spans:
            return None
        # The skeleton holds every key, number and short string of the text, and its nesting:
        # parsed by jiter as the whole text would be. A long key put back that an object
        # already has is a duplicate key.
        value = pieces.put_back(loads_large(parts.skeleton), parts.strings(), unique=True)
        self._check_depth(parts.skeleton)
        if not self._typed:
            return value  # type: ignore[no-any-return]
        message: M = msgspec.convert(value, self._type)
        return self._check_revision(message)

    def _decode_large(self, payload: bytes) -> M:
        # jiter checks duplicate keys while parsing and scans long strings far faster than a
        # parse followed by a second pass over the text would.
        try:
            value = loads_large(payload)
        except JSONError as error:
            raise FrameError(FrameErrorKind.INVALID_JSON, _DECODE_PREFIX + str(error)) from None
        self._check_depth(payload)
        if not self._typed:
            return value  # type: ignore[no-any-return]
        try:
            message: M = msgspec.convert(value, self._type)
        except msgspec.ValidationError as error:
            raise FrameError(
                FrameErrorKind.INVALID_MESSAGE, _DECODE_PREFIX + _validation_detail(error)
            ) from None
        return self._check_revision(message)


class LargePayload(Generic[M]):
    """A payload of ``apart_from`` bytes or more (:class:`MessageDecoder`), not decoded yet.

    :meth:`decode` gives what :meth:`MessageDecoder.decode` would have given (or raises the same
    :class:`FrameError`), by :meth:`MessageDecoder.decode_apart`: pure, for a worker thread.
    ``data`` must not change until it returned."""

    __slots__ = ("_decoder", "data", "end", "start")

    def __init__(self, decoder: MessageDecoder[M], data: bytes | bytearray, start: int, end: int):
        self._decoder = decoder
        self.data = data
        self.start = start
        self.end = end

    def __len__(self) -> int:
        return self.end - self.start

    def decode(self) -> M:
        """The message, or :class:`FrameError`."""
        return self._decoder.decode_apart(self.data, self.start, self.end)


class DecodeApart(Exception):
    """Raised by a :class:`MessageDecoder` made with ``apart_from`` (through
    :class:`FrameDecoder` and :func:`decode_framed`, the frame consumed) instead of decoding a
    large payload: ``payload`` is for its caller to decode elsewhere. Raising costs a small
    frame nothing (an exception is free until raised); a returned marker would cost a check
    per message."""

    def __init__(self, payload: LargePayload[Any]) -> None:
        super().__init__(len(payload))
        self.payload = payload


def _check_json(payload: bytes | bytearray) -> None:
    try:
        check_no_duplicate_keys(payload, _ANY_DECODER.decode(payload))
    except msgspec.DecodeError as error:
        detail = decode_error_detail(error, payload)
        raise FrameError(FrameErrorKind.INVALID_JSON, _DECODE_PREFIX + detail) from None
    except JSONError as error:
        raise FrameError(FrameErrorKind.INVALID_JSON, _DECODE_PREFIX + str(error)) from None


class PayloadDecoder(Protocol[M_co]):
    """Turns one frame's payload ``data[start:end]`` into a value."""

    def decode(self, data: bytes | bytearray, start: int = 0, end: int | None = None) -> M_co: ...


class RawPayloads:
    """A decoder that keeps payloads as bytes, for carriers that split frames but do not read them."""

    __slots__ = ()

    def decode(self, data: bytes | bytearray, start: int = 0, end: int | None = None) -> bytes:
        """The payload bytes ``data[start:end]``."""
        return bytes(memoryview(data)[start : len(data) if end is None else end])


def encode_payload(message: Any) -> bytes:
    """Encode a message (or any JSON value) canonically, without the length prefix."""
    try:
        return _ENCODER.encode(message)
    except (TypeError, ValueError, OverflowError) as error:
        raise FrameError(FrameErrorKind.INVALID_MESSAGE, _ENCODE_PREFIX + str(error)) from None


def encode_frame(message: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytearray:
    """Encode a message as one complete frame (prefix + payload), or raise ``oversize``.

    The payload is encoded straight after a reserved prefix, so a large frame is never copied.
    """
    buffer = bytearray(_PREFIX)
    try:
        _ENCODER.encode_into(message, buffer, _PREFIX)
    except (TypeError, ValueError, OverflowError) as error:
        raise FrameError(FrameErrorKind.INVALID_MESSAGE, _ENCODE_PREFIX + str(error)) from None
    length = len(buffer) - _PREFIX
    if length > max_frame_bytes:
        raise oversize_error(length, max_frame_bytes)
    buffer[:_PREFIX] = length.to_bytes(_PREFIX, "little")
    return buffer


def into_framed_bytes(payload: bytes | bytearray) -> bytes:
    """Prefix an already encoded payload with its length."""
    if len(payload) > MAX_FRAME_BYTES:
        raise oversize_error(len(payload))
    return len(payload).to_bytes(_PREFIX, "little") + payload


def decode_framed(buffer: bytes | bytearray, decoder: MessageDecoder[M]) -> M:
    """Decode a buffer that must hold exactly one frame (one WebSocket message, §6.4)."""
    size = len(buffer)
    if size < _PREFIX:
        raise FrameError(
            FrameErrorKind.TRUNCATED_PREFIX, "code-mode IPC frame is missing its length prefix"
        )
    length = int.from_bytes(buffer[:_PREFIX], "little")
    if length > MAX_FRAME_BYTES:
        raise oversize_error(length)
    received = size - _PREFIX
    if received != length:
        kind = (
            FrameErrorKind.TRUNCATED_PAYLOAD if received < length else FrameErrorKind.TRAILING_BYTES
        )
        raise FrameError(
            kind, f"code-mode IPC frame declares {length} payload bytes but contains {received}"
        )
    return decoder.decode(buffer, _PREFIX, size)


class FrameDecoder(Generic[M]):
    """Incremental frame reader: feed bytes with :meth:`receive_data`, pull messages.

    :meth:`next_message` returns a message, :data:`NEED_DATA`, or :data:`EOF` (only at a frame
    boundary after :meth:`receive_eof`), and raises :class:`FrameError`. After ``invalid_json`` or
    ``invalid_message`` the decoder continues with the next frame; any other error is final.
    """

    __slots__ = ("_buffer", "_decoder", "_eof", "_failed", "_limit", "_position", "consumed")

    def __init__(self, decoder: PayloadDecoder[M], max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder = decoder
        self._limit = max_frame_bytes
        self._buffer: bytes | bytearray = b""
        self._position = 0
        self._eof = False
        self._failed: FrameError | None = None
        #: Stream offset of the first byte not yet consumed (the start of the next frame).
        self.consumed = 0

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes."""
        if self._eof:
            raise RuntimeError("received data after end of stream")
        if not data:
            return
        if self._position >= len(self._buffer):
            # Nothing pending: decode straight out of the caller's chunk.
            # A caller may reuse a mutable buffer, so only immutable bytes are kept as they are.
            self._buffer = data if isinstance(data, bytes) else bytes(data)
            self._position = 0
            return
        if isinstance(self._buffer, bytes):
            self._buffer = bytearray(memoryview(self._buffer)[self._position :])
        elif self._position:
            del self._buffer[: self._position]
        self._position = 0
        self._buffer += data

    def receive_eof(self) -> None:
        """Mark the end of the stream."""
        self._eof = True

    def next_message(self) -> M | _Sentinel:
        """Return the next message, :data:`NEED_DATA` or :data:`EOF`; raise :class:`FrameError`."""
        if self._failed is not None:
            raise self._failed
        buffer, position = self._buffer, self._position
        available = len(buffer) - position
        if available < _PREFIX:
            if not self._eof:
                return NEED_DATA
            if available == 0:
                return EOF
            raise self._fail(
                FrameError(
                    FrameErrorKind.TRUNCATED_PREFIX,
                    f"code-mode IPC frame length prefix truncated after {available} bytes",
                )
            )
        length = int.from_bytes(buffer[position : position + _PREFIX], "little")
        if length > self._limit:
            raise self._fail(oversize_error(length, self._limit))
        end = position + _PREFIX + length
        if len(buffer) < end:
            if not self._eof:
                return NEED_DATA
            raise self._fail(
                FrameError(
                    FrameErrorKind.TRUNCATED_PAYLOAD,
                    "code-mode IPC frame payload truncated: "
                    f"declared {length} bytes, received {available - _PREFIX}",
                )
            )
        self._position = end
        self.consumed += _PREFIX + length
        if end == len(buffer):
            self._buffer, self._position = b"", 0
        return self._decoder.decode(buffer, position + _PREFIX, end)

    def _fail(self, error: FrameError) -> FrameError:
        self._failed = error
        return error
