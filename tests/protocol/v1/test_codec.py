"""Properties of the frame codec: round trips, any chunking, arbitrary bytes never escape."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from codemode.errors import FrameError
from codemode.protocol.v1 import (
    EOF,
    NEED_DATA,
    FrameDecoder,
    MessageDecoder,
    decode_framed,
    encode_frame,
    encode_payload,
)
from codemode.protocol.v1.messages import ClientToHost, HostToClient
from tests.protocol.v1.strategies import client_to_host, host_to_client

CLIENT = MessageDecoder[Any](ClientToHost)
HOST = MessageDecoder[Any](HostToClient)


def drain(reader: FrameDecoder[Any], chunks: list[bytes]) -> list[Any]:
    """Every outcome of a stream fed as ``chunks``; stops at EOF or a final error."""
    outcomes: list[Any] = []
    pending = iter(chunks)
    while True:
        try:
            message = reader.next_message()
        except FrameError as error:
            outcomes.append(error.kind)
            if not error.stream_usable:
                return outcomes
            continue
        if message is NEED_DATA:
            piece = next(pending, None)
            if piece is None:
                reader.receive_eof()
            else:
                reader.receive_data(piece)
        elif message is EOF:
            return outcomes
        else:
            outcomes.append(message)


@given(client_to_host)
def test_client_messages_round_trip(message: Any) -> None:
    assert CLIENT.decode(encode_payload(message)) == message
    assert decode_framed(encode_frame(message), CLIENT) == message


@given(host_to_client)
def test_host_messages_round_trip(message: Any) -> None:
    assert HOST.decode(encode_payload(message)) == message


@settings(max_examples=50)
@given(st.lists(host_to_client, min_size=1, max_size=4), st.data())
def test_any_split_decodes_identically(messages: list[Any], data: st.DataObject) -> None:
    stream = b"".join(bytes(encode_frame(message)) for message in messages)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(stream)), max_size=8)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    assert drain(FrameDecoder(HOST), chunks) == messages


def test_every_single_split_point() -> None:
    messages = [
        HOST.decode(b'{"type":"delegate/cancel","id":7}'),
        HOST.decode(b'{"type":"cell/closed","sessionId":"s","cellId":"\xc3\xa9"}'),
    ]
    stream = b"".join(bytes(encode_frame(message)) for message in messages)
    for cut in range(len(stream) + 1):
        chunks = [stream[:cut], stream[cut:]]
        assert drain(FrameDecoder(HOST), chunks) == messages


@settings(max_examples=300)
@given(st.binary(max_size=200), st.lists(st.integers(1, 16), max_size=20))
def test_arbitrary_bytes_only_raise_frame_errors(data: bytes, sizes: list[int]) -> None:
    chunks: list[bytes] = []
    position = 0
    for size in sizes:
        chunks.append(data[position : position + size])
        position += size
    chunks.append(data[position:])
    outcomes = drain(FrameDecoder(CLIENT), [c for c in chunks if c])
    # Termination is the property; every outcome is a message or a typed error kind.
    assert len(outcomes) <= len(data) // 4 + 1


@settings(max_examples=200)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_framed_garbage_payloads_keep_the_stream_aligned(payloads: list[bytes]) -> None:
    stream = b"".join(len(p).to_bytes(4, "little") + p for p in payloads)
    outcomes = drain(FrameDecoder(MessageDecoder(Any)), [stream])
    assert len(outcomes) == len(payloads)
