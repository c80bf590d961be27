"""A host's large client frames are decoded apart, off its event loop (decision 0025, addendum).

msgspec and jiter hold the GIL through one call: one client's frame of 66 MB of backslashes held
the loop every connection of a host shares for 0.25-0.4 s. A host machine made with
``large_frames_apart`` hands such a frame to its glue (:class:`LargeFrame`) and takes in nothing
more until the glue gives back what :meth:`LargePayload.decode` made of it, on a worker thread
and a piece at a time. That must be exactly what one decode gives, messages and error texts, and
the frames after it must be taken in after it.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codemode.errors import FrameError, FrameErrorKind, LocalProtocolError
from codemode.protocol import pieces, strict_json
from codemode.protocol.v1 import codec
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1.codec import (
    LARGE_FRAME_BYTES,
    UPSTREAM_MAX_NESTING,
    DecodeApart,
    LargePayload,
    MessageDecoder,
)
from codemode.protocol.v1.host import HostProtocol
from codemode.protocol.v1.messages import (
    ClientToHost,
    DelegateResponseMessage,
    OperationRequest,
    SessionExecute,
    SessionOpen,
    ToolResult,
    WireExecuteRequest,
    WireOk,
)
from tests.loop_encodes import watch_decoders
from tests.protocol.test_pieces import ALPHABET
from tests.wire import HELLO, frame

HOST_DECODER = MessageDecoder[Any](ClientToHost, max_depth=UPSTREAM_MAX_NESTING)
ANY_DECODER = MessageDecoder[Any](max_depth=UPSTREAM_MAX_NESTING)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pieces of 16 units, literals of 40 or more (as tests/protocol/test_pieces.py); every payload
    # takes the large payloads' path, as a frame of LARGE_FRAME_BYTES does.
    monkeypatch.setattr(pieces, "PIECE", 16)
    monkeypatch.setattr(pieces, "LONG", 40)
    monkeypatch.setattr(codec, "LARGE_PAYLOAD_BYTES", 0)


def outcome(decode: Any) -> tuple[Any, ...]:
    try:
        return ("message", decode())
    except FrameError as error:
        return ("error", error.kind, error.message)


def both(payload: bytes, decoder: MessageDecoder[Any] = HOST_DECODER) -> tuple[Any, Any]:
    """What one decode gives, and what the decode apart gives."""
    return outcome(lambda: decoder.decode(payload)), outcome(lambda: decoder.decode_apart(payload))


# -- frames: JSON texts written by hand, duplicate keys and odd bytes included ------------------

#: Strings, most of them long (40 units of JSON or more, with the small pieces) once escaped.
_STRINGS = st.text(ALPHABET, max_size=30) | st.text(ALPHABET, min_size=30, max_size=90)


def _json_string(value: str, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


@st.composite
def _json_text(draw: st.DrawFn, depth: int = 0) -> str:
    """A JSON value's text: objects may repeat a key (as a text the client wrote may)."""
    ascii_only = draw(st.booleans())
    kind = draw(
        st.sampled_from(
            ["str", "str", "num", "lit", "list", "dict"] if depth < 4 else ["str", "num"]
        )
    )
    if kind == "str":
        return _json_string(draw(_STRINGS), ascii_only)
    if kind == "num":
        return draw(st.sampled_from(["0", "-1", "2.5", "1e3", "18446744073709551616", "1e400"]))
    if kind == "lit":
        return draw(st.sampled_from(["null", "true", "false"]))
    items = draw(st.lists(_json_text(depth + 1), max_size=4))
    if kind == "list":
        return "[" + ",".join(items) + "]"
    keys = draw(st.lists(_STRINGS, min_size=len(items), max_size=len(items)))
    if keys and draw(st.integers(0, 4)) == 0:
        keys[-1] = keys[0]  # a repeated key
    pairs = [
        f"{_json_string(key, ascii_only)}:{item}" for key, item in zip(keys, items, strict=True)
    ]
    return "{" + ",".join(pairs) + "}"


#: What a mutation puts in a frame: bytes that break JSON, strings, UTF-8 or surrogates.
_ODD = [
    b"\\",
    b'"',
    b"\\ud800",
    b"\\udc00",
    b"\xff",
    b"\xed\xa0\x80",
    b"\xe4\xb8",
    b"\x01",
    b"{",
    b"]",
    b",",
    b":",
    b"1e400",
    b"",
    b'\\"',
]


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """A delegate/response payload (or any JSON value), with a few odd bytes put in or taken out
    now and then."""
    result = draw(_json_text())
    if draw(st.integers(0, 3)) == 0:
        text = result  # not a message at all
    else:
        text = (
            '{"type":"delegate/response","id":7,"result":{"status":"ok","value":'
            '{"type":"tool/result","result":' + result + "}}}"
        )
    if draw(st.integers(0, 9)) == 0:
        text = "[" * 130 + text + "]" * 130  # past UPSTREAM_MAX_NESTING
    data = text.encode("utf-8", "surrogatepass")
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        at = draw(st.integers(0, len(data)))
        cut = draw(st.integers(0, 2))
        data = data[:at] + draw(st.sampled_from(_ODD)) + data[at + cut :]
    return data


@pytest.fixture(params=[1, 32], ids=["parsed", "as-sized"])
def few_values(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # "parsed": every typed payload takes the parse the pieces stand in for (the small frames
    # here have a comma every few bytes, which would make most of them "many values", decoded
    # typed and whole by both).
    monkeypatch.setattr(codec, "_FEW_VALUES", request.param)


@pytest.mark.usefixtures("small", "few_values")
@settings(max_examples=500, deadline=None)
@given(frames())
def test_a_frame_decoded_apart_gives_what_one_decode_gives(payload: bytes) -> None:
    whole, apart = both(payload)
    assert apart == whole
    whole, apart = both(payload, ANY_DECODER)
    assert apart == whole


@pytest.mark.usefixtures("small")
@pytest.mark.parametrize(
    "payload",
    [
        # Long keys repeated, as they are and as a short key written otherwise.
        '{"' + "\\\\" * 30 + '":1,"' + "\\\\" * 30 + '":2}',
        '{"' + "a" * 12 + '":1,"' + "\\u0061" * 12 + '":2}',
        # A long string that is not one: an escape cut short, a lone surrogate, bad UTF-8.
        '["' + "\\\\" * 30 + '\\u12"]',
        '["' + "\\\\" * 30 + '\\ud800"]',
        '["' + "\\\\" * 30 + '\\udc00\\ud800"]',
        '["' + "x" * 60 + '\xff"]',
        '["' + "\\\\" * 30 + '\\ud83d\\ude00"]',  # a surrogate pair: taken
        # A backslash outside strings, before and after a long one; unterminated.
        '[\\"' + "x" * 60 + '"]',
        '["' + "x" * 60 + '"\\]',
        '["' + "x" * 60,
        # Too deep, beside a long string; a number out of range; not a message.
        "[" * 128 + '"' + "x" * 60 + '"' + "]" * 128,
        '["' + "x" * 60 + '", 1e400]',
        '{"type":"delegate/response","id":"7","result":"' + "x" * 60 + '"}',
        '{"type":"' + "x" * 60 + '"}',
    ],
)
def test_odd_frames_decoded_apart_fail_as_one_decode_fails(payload: str) -> None:
    data = payload.encode("utf-8", "surrogateescape")
    whole, apart = both(data)
    assert apart == whole
    untyped_whole, untyped_apart = both(data, ANY_DECODER)  # any JSON value too
    assert untyped_apart == untyped_whole


def test_a_large_frame_is_decoded_a_piece_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # No decode call of a large frame's takes more than a piece of its long strings.
    sizes = watch_decoders(monkeypatch, (pieces, "_STRING"))

    def loads_large(data: bytes) -> Any:
        sizes.append(len(data))
        return codec_loads_large(data)

    codec_loads_large = strict_json.loads_large
    monkeypatch.setattr(codec, "loads_large", loads_large)
    message = DelegateResponseMessage(
        7, WireOk(ToolResult({"\\" * 2_000_000: ["\x01" * 500_000, "é" * 1_000_000, 1.5]}))
    )
    payload = msgspec.json.encode(message)
    decoder = MessageDecoder[Any](
        ClientToHost, max_depth=UPSTREAM_MAX_NESTING, apart_from=LARGE_FRAME_BYTES
    )
    with pytest.raises(DecodeApart) as apart:
        decoder.decode(payload)
    assert apart.value.payload.decode() == message
    assert sizes and max(sizes) <= pieces.PIECE + 2


def test_the_threshold_is_where_a_long_literal_can_begin() -> None:
    assert LARGE_FRAME_BYTES == pieces.LONG


# -- the host machine: the frame handed on, what follows held --------------------------------------

#: A source long enough to make its execute request a large frame (each backslash two bytes).
LONG_SOURCE = "//" + "\\" * (LARGE_FRAME_BYTES // 2)


def _open(request_id: int) -> bytes:
    return frame(OperationRequest(request_id, SessionOpen(f"s{request_id}")))


def _execute(request_id: int, source: str) -> bytes:
    body = WireExecuteRequest(f"call-{request_id}", [], source, 1000, None)
    return frame(OperationRequest(request_id, SessionExecute("s1", body)))


def _decoded(payload: LargePayload[Any]) -> Any:
    try:
        return payload.decode()
    except FrameError as error:
        return error


def _taken_in(protocol: HostProtocol) -> list[Any]:
    """The machine's events, each large frame decoded and given back as the glue does."""
    events: list[Any] = []
    while True:
        batch = protocol.events_received()
        if not batch:
            return events
        for event in batch:
            if isinstance(event, ev.LargeFrame):
                assert protocol.decoding_apart
                assert protocol.events_received() == []  # nothing taken in meanwhile
                protocol.receive_decoded(_decoded(event.payload))
            else:
                events.append(event)


def test_a_frame_pipelined_after_a_large_one_is_taken_in_after_it() -> None:
    protocol = HostProtocol(large_frames_apart=True)
    protocol.receive_data(frame(HELLO) + _open(1))
    assert [type(event) for event in protocol.events_received()] == [
        ev.HandshakeComplete,
        ev.OpenSession,
    ]
    # One read: the large frame, and a small one right behind it in the same buffer.
    protocol.receive_data(_execute(2, LONG_SOURCE) + _open(3))
    [large] = protocol.events_received()
    assert isinstance(large, ev.LargeFrame)
    protocol.receive_data(_open(4))  # read while it is decoded: held
    assert protocol.events_received() == []
    protocol.receive_decoded(large.payload.decode())
    events: list[Any] = protocol.events_received()
    assert [type(event) for event in events] == [ev.StartExecute, ev.OpenSession, ev.OpenSession]
    assert [event.request_id for event in events] == [2, 3, 4]
    assert events[0].request.source == LONG_SOURCE


@pytest.mark.parametrize("whole_frames", [False, True], ids=["stream", "websocket"])
@pytest.mark.parametrize("seed", range(12))
def test_what_a_machine_handing_large_frames_on_takes_in_is_what_one_decoding_them_takes_in(
    whole_frames: bool, seed: int
) -> None:
    # The same input to a machine that decodes every frame itself and to one that hands large
    # frames on: the same events in the same order, the same frames written, the same end.
    chooser = random.Random(seed)
    frames_ = [frame(HELLO), _open(1)]
    for request_id in range(2, chooser.randint(3, 9)):
        roll = chooser.random()
        if roll < 0.35:
            frames_.append(_execute(request_id, LONG_SOURCE))
        elif roll < 0.45:  # large, and not JSON: the connection ends with the decode's text
            frames_.append(frame(b'["' + b"\\" * LARGE_FRAME_BYTES + b'\\x"]'))
        elif roll < 0.55:  # large, and a repeated long key
            key = b'"' + b"\\" * LARGE_FRAME_BYTES + b'"'
            frames_.append(frame(b"{" + key + b":1," + key + b":2}"))
        else:
            frames_.append(_open(request_id))
    ending = chooser.choice(["eof", "read failed", "text", "none"])
    plain, apart = HostProtocol(), HostProtocol(large_frames_apart=True)
    if whole_frames:
        for each in frames_:
            for protocol in (plain, apart):
                protocol.receive_frame(each)
    else:
        data = b"".join(frames_)
        cuts = sorted(chooser.sample(range(1, len(data)), 6))
        for begin, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            for protocol in (plain, apart):
                protocol.receive_data(data[begin:end])
    for protocol in (plain, apart):
        if ending == "eof":
            protocol.receive_eof()
        elif ending == "read failed":
            protocol.read_failed("reset by peer")
        elif ending == "text":
            protocol.text_received()
    assert _taken_in(apart) == plain.events_received()
    assert apart.data_to_send() == plain.data_to_send()
    assert apart.failure == plain.failure
    assert not apart.decoding_apart


def test_a_machine_without_large_frames_apart_decodes_them_itself() -> None:
    protocol = HostProtocol()
    protocol.receive_data(frame(HELLO) + _open(1) + _execute(2, LONG_SOURCE))
    assert [type(event) for event in protocol.events_received()] == [
        ev.HandshakeComplete,
        ev.OpenSession,
        ev.StartExecute,
    ]


def test_a_decoded_frame_nobody_handed_on_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        HostProtocol(large_frames_apart=True).receive_decoded(
            FrameError(FrameErrorKind.INVALID_JSON, "x")
        )
