"""``codec.json``: frame bytes, clean EOF, every framing error, alignment, single-buffer form."""

from __future__ import annotations

from typing import Any

import pytest

from codemode.errors import FrameError, FrameErrorKind
from codemode.protocol.v1 import (
    EOF,
    NEED_DATA,
    WIRE_TYPES,
    FrameDecoder,
    MessageDecoder,
    decode_framed,
    encode_frame,
    encode_payload,
)
from tests.conformance.vectors import params


def decoder_for(entry: dict[str, Any]) -> MessageDecoder[Any]:
    name = entry.get("decode_as", "json")
    return MessageDecoder(Any if name == "json" else WIRE_TYPES[name])


def as_json(value: Any) -> Any:
    import json

    return json.loads(encode_payload(value))


def read_all(data: bytes, decoder: MessageDecoder[Any], chunk: int | None) -> list[Any]:
    """Feed ``data`` (all at once, or ``chunk`` bytes at a time) and collect outcomes."""
    reader: FrameDecoder[Any] = FrameDecoder(decoder)
    chunks = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    outcomes: list[Any] = []
    pending = iter(chunks)
    while True:
        try:
            message = reader.next_message()
        except FrameError as error:
            outcomes.append({"error": error.kind.value})
            if not error.stream_usable:
                return outcomes
            continue
        if message is NEED_DATA:
            piece = next(pending, None)
            if piece is None:
                reader.receive_eof()
            else:
                reader.receive_data(piece)
            continue
        if message is EOF:
            outcomes.append("clean_eof")
            return outcomes
        outcomes.append({"ok": as_json(message)})


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "bytewise"])
@pytest.mark.parametrize("entry", params("codec.json", mode="stream"))
def test_stream(entry: dict[str, Any], chunk: int | None) -> None:
    data = bytes.fromhex(entry.get("hex", ""))
    assert read_all(data, decoder_for(entry), chunk) == entry["expect"]


@pytest.mark.parametrize("entry", params("codec.json", mode="message"))
def test_message(entry: dict[str, Any]) -> None:
    data = bytes.fromhex(entry.get("hex", ""))
    expect = entry["expect"]
    if "ok" in expect:
        assert as_json(decode_framed(data, decoder_for(entry))) == expect["ok"]
    else:
        with pytest.raises(FrameError) as caught:
            decode_framed(data, decoder_for(entry))
        assert caught.value.kind.value == expect["error"]


@pytest.mark.parametrize("entry", params("codec.json", mode="encode"))
def test_encode(entry: dict[str, Any]) -> None:
    assert bytes(encode_frame(entry["value"])).hex() == entry["expect"]["hex"]


@pytest.mark.slow
@pytest.mark.parametrize("entry", params("codec.json", mode="encode_synthetic"))
def test_encode_synthetic(entry: dict[str, Any]) -> None:
    value = "x" * entry["string_length"]
    expect = entry["expect"]
    if "error" in expect:
        with pytest.raises(FrameError) as caught:
            encode_frame(value)
        assert caught.value.kind is FrameErrorKind.OVERSIZE
        return
    frame = encode_frame(value)
    assert bytes(frame[:4]).hex() == expect["prefix_hex"]
    assert len(frame) - 4 == expect["payload_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 1 << 20], ids=["whole", "chunked"])
@pytest.mark.parametrize("entry", params("codec.json", mode="stream_synthetic"))
def test_stream_synthetic(entry: dict[str, Any], chunk: int | None) -> None:
    data = (
        entry["declared_length"].to_bytes(4, "little") + b'"' + b"x" * entry["string_length"] + b'"'
    )
    outcomes = read_all(data, MessageDecoder(Any), chunk)
    got = [
        {"ok_string_length": len(o["ok"])} if isinstance(o, dict) and "ok" in o else o
        for o in outcomes
    ]
    assert got == entry["expect"]


def test_error_messages_are_exact() -> None:
    cases = [
        (b"\x01\x00", "code-mode IPC frame length prefix truncated after 2 bytes"),
        (b"\x01\x00\x00\x05", "code-mode IPC frame length 83886081 exceeds 67108864 bytes"),
        (
            b"\x05\x00\x00\x00{}",
            "code-mode IPC frame payload truncated: declared 5 bytes, received 2",
        ),
    ]
    for data, message in cases:
        reader: FrameDecoder[Any] = FrameDecoder(MessageDecoder(Any))
        reader.receive_data(data)
        reader.receive_eof()
        with pytest.raises(FrameError) as caught:
            reader.next_message()
        assert str(caught.value) == message
        # The error is final: the reader stays failed.
        with pytest.raises(FrameError):
            reader.next_message()


def test_single_buffer_messages_are_exact() -> None:
    decoder: MessageDecoder[Any] = MessageDecoder(Any)
    with pytest.raises(FrameError, match=r"^code-mode IPC frame is missing its length prefix$"):
        decode_framed(b"\x00", decoder)
    with pytest.raises(
        FrameError, match=r"^code-mode IPC frame declares 3 payload bytes but contains 4$"
    ):
        decode_framed(b"\x03\x00\x00\x00[1] ", decoder)
