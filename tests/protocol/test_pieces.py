"""Long strings of the engine's messages are decoded a piece at a time (decision 0022, addendum).

msgspec holds the GIL through one call and decodes text that JSON escapes at 250-500 MB/s: one
engine frame of 63 M backslashes held the event loop every session shares for a second, on a
worker thread as much as on the loop. :mod:`codemode.protocol.pieces` finds a JSON text's long
string literals and decodes them in pieces; what it gives must be exactly what one decode gives,
and what is not JSON must fail as one decode fails.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Any, cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codemode.protocol import InputText, pieces
from codemode.runtime import engine as engine_module
from codemode.runtime.engine import _HostProtocol
from tests.runtime.test_engine_messages import wired
from tests.wire import frame

#: Characters JSON escapes (two bytes, six) or writes in UTF-8 of every length.
ALPHABET = '\\"\x01\x1f\u2028/\n\té一😀x'


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pieces of 16 units, literals of 40 or more: every cut lands somewhere in an escape's
    # neighbourhood, many inside one, a surrogate pair's or a UTF-8 sequence.
    monkeypatch.setattr(pieces, "PIECE", 16)
    monkeypatch.setattr(pieces, "LONG", 40)


def _text(chooser: random.Random, length: int) -> str:
    return "".join(chooser.choice(ALPHABET) for _ in range(length))


def _decoded(text: Any) -> Any:
    split = pieces.split(text)
    return pieces.put_back(msgspec.json.decode(split.skeleton), split.strings())


@pytest.mark.usefixtures("small")
@pytest.mark.parametrize("form", ["str", "bytes", "bytearray"])
@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "raw-utf8"])
def test_a_text_decoded_in_pieces_is_what_one_decode_gives(form: str, ascii_only: bool) -> None:
    chooser = random.Random(7)
    long_ones = 0
    for _ in range(400):
        value = {
            _text(chooser, chooser.randint(0, 60)): [
                _text(chooser, chooser.randint(0, 90)),
                1.5,
                {"k": _text(chooser, chooser.randint(0, 120)), "n": None},
            ],
            "a": _text(chooser, chooser.randint(0, 5)),
        }
        text = json.dumps(value, ensure_ascii=ascii_only)
        source: Any = text if form == "str" else text.encode()
        if form == "bytearray":
            source = bytearray(source)
        long_ones += len(pieces.split(source).spans)
        assert _decoded(source) == value
    assert long_ones > 400  # most values had long literals, keys among them


@pytest.mark.usefixtures("small")
@pytest.mark.parametrize(
    "string",
    [
        "\\" * 101,  # every other cut inside an escaped backslash
        "\x01" * 50,  # \u0001: a cut inside the escape five times in six
        "😀" * 50,  # escaped as a surrogate pair (ensure_ascii), or 4 bytes of UTF-8
        '"' * 77,
        "é一" * 40,
    ],
)
def test_cuts_never_split_an_escape_a_surrogate_pair_or_a_utf8_sequence(string: str) -> None:
    for text in (json.dumps([string]), json.dumps([string], ensure_ascii=False)):
        for source in (text, text.encode()):
            assert pieces.split(source).spans
            assert _decoded(source) == [string]


@pytest.mark.usefixtures("small")
@pytest.mark.parametrize(
    "text",
    [
        '["' + "x" * 50,  # unterminated
        '["' + "x" * 50 + '\\"]',  # the closing quote escaped
        '["' + "x" * 30 + "\\ud83d" + "x" * 30 + '"]',  # a lone surrogate escape
        '["' + "x" * 30 + "\\u12g4" + "x" * 30 + '"]',  # not an escape
        '["' + "x" * 30 + "\\q" + "x" * 30 + '"]',
        '["' + "x" * 30 + "\x01" + "x" * 30 + '"]',  # a raw control character
    ],
)
def test_what_one_decode_refuses_is_refused(text: str) -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(text)
    for source in (text, text.encode()):
        with pytest.raises(msgspec.DecodeError):
            _decoded(source)


@pytest.mark.usefixtures("small")
def test_invalid_utf8_in_a_long_literal_is_refused() -> None:
    source = b'["' + b"x" * 30 + b"\xed\xa0\x80" + b"x" * 30 + b'"]'  # an encoded surrogate
    with pytest.raises(msgspec.DecodeError):
        _decoded(source)


def test_no_decode_call_is_longer_than_a_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []

    class Watched:
        def decode(self, data: Any) -> Any:
            sizes.append(len(data))
            return msgspec.json.decode(data, type=str)

    monkeypatch.setattr(pieces, "_STRING", Watched())
    text = json.dumps(["\\" * 3_000_000, "\x01" * 1_000_000]).encode()
    split = pieces.split(text)
    assert len(split.skeleton) < 200
    assert pieces.put_back(msgspec.json.decode(split.skeleton), split.strings()) == [
        "\\" * 3_000_000,
        "\x01" * 1_000_000,
    ]
    assert sizes and max(sizes) <= pieces.PIECE + 2


# -- the engine's frames -------------------------------------------------------------------------

LONG_TEXT = "\\" * (1 << 20)


async def _until(condition: Any) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_large_frame_is_decoded_on_a_worker_thread_and_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Guards: a frame of LARGE_FRAME_BYTES or more is decoded off the event loop, and the
    # engine's later frames wait for it (the pipe is not read meanwhile).
    threads: list[int] = []
    decoded_large = engine_module._decoded_large

    def watched(large: Any) -> Any:
        threads.append(threading.get_ident())
        return decoded_large(large)

    monkeypatch.setattr(engine_module, "_decoded_large", watched)
    _, protocol, events, transport = wired()
    item = {"t": "item", "cell": 1, "type": "input_text", "value": LONG_TEXT}
    protocol.data_received(frame([item]) + frame([{"t": "yield", "cell": 1, "turn": 3}]))
    assert events.seen == []  # not decoded on the loop
    await _until(lambda: len(events.seen) == 2)
    assert events.seen == [("item", InputText(LONG_TEXT)), ("yield", 3)]
    assert threads and threading.get_ident() not in threads
    assert not transport.killed


@pytest.mark.parametrize(
    "message",
    [
        {"t": "call", "cell": 1, "id": LONG_TEXT, "tool": 0, "input": None},
        {"t": "exited", "cell": 1, "reason": "crashed", "detail": LONG_TEXT},
        {"t": "item", "cell": 1, "type": "input_text", "value": "x", LONG_TEXT: 1},
        {"t": "item", "cell": 1, "type": LONG_TEXT, "value": "x"},
    ],
    ids=["call-id", "exit-detail", "key", "literal"],
)
async def test_a_long_string_where_a_bounded_one_belongs_is_a_breach(
    message: dict[str, Any],
) -> None:
    # The bounds of a call id and an exit detail were checked on a placeholder: the long string
    # is not put there.
    _, protocol, events, transport = wired()
    protocol.data_received(frame([message]))
    await _until(lambda: transport.killed)
    assert events.seen[-1] == ("exited", "crashed")


@pytest.mark.parametrize("large", [False, True], ids=["small-frame", "large-frame"])
async def test_spliced_inputs_and_writes_arrive_as_their_text_and_strings(large: bool) -> None:
    # host.js writes a long tool input and long store writes into the frame as JSON values
    # (escaped once, not twice); in a large frame their long strings come decoded, beside a
    # text that holds a placeholder for each.
    engine, protocol, events, transport = wired()
    engine._deferrable = False
    string = LONG_TEXT if large else "\\\\"
    value = {"s": string, "n": [1, 2]}
    writes = [["k", json.dumps(string)]]
    body = (
        '[{"t":"call","cell":1,"id":"tool-1","tool":0,"json":'
        + json.dumps(value)
        + '},{"t":"done","cell":1,"error":null,"entries":'
        + json.dumps(writes)
        + "}]"
    ).encode()
    protocol.data_received(frame(body))
    await _until(lambda: len(events.seen) == 2)
    assert not transport.killed
    (kind, call), (_, done) = events.seen
    assert kind == "call"
    if large:
        call_id, tool, text, strings = call
        assert (call_id, tool) == ("tool-1", 0)
        assert len(text) < 200 and list(strings.values()) == [string]
        assert pieces.put_back(json.loads(text), strings) == value
    else:
        assert call == ("tool-1", 0, json.dumps(value))  # the value's text, as it came
    assert done == (None, [("k", json.dumps(string))], None)


async def test_an_exit_while_a_large_frame_is_decoded_comes_after_its_messages() -> None:
    engine, protocol, events, _ = wired()
    engine._reader = protocol
    item = {"t": "item", "cell": 1, "type": "input_text", "value": LONG_TEXT}
    protocol.data_received(frame([item]))
    assert events.seen == []
    _HostProtocol(engine).process_exited()
    assert events.seen == [("item", InputText(LONG_TEXT)), ("exited", "crashed")]
    await asyncio.sleep(0.2)  # the worker thread's decoding, when it ends, changes nothing
    assert len(events.seen) == 2


# -- encoding ------------------------------------------------------------------------------------

_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(ALPHABET, max_size=60),
    lambda children: (
        st.lists(children, max_size=12)
        | st.dictionaries(st.text(ALPHABET, max_size=50), children, max_size=12)
    ),
    max_leaves=60,
)


@pytest.mark.usefixtures("small")
@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_a_value_encoded_in_pieces_is_what_one_encode_gives(value: Any) -> None:
    whole = msgspec.json.encode(value)
    assert bytes(cast(bytearray, pieces.encode(value))) == whole
    assert bytes(cast(bytearray, pieces.encode(value, limit=len(whole)))) == whole
    if whole:
        assert pieces.encode(value, limit=len(whole) - 1) == len(whole)  # only counted


@pytest.mark.usefixtures("small")
@settings(max_examples=100, deadline=None)
@given(_JSON_VALUES)
def test_heavy_says_so_for_every_value_past_a_piece(value: Any) -> None:
    # Never a false "light": one it calls light has at most a piece of characters (each six
    # bytes at most, escaped) and 1,024 values (each at most a number's 24 and three marks).
    if not pieces.heavy(value):
        assert len(msgspec.json.encode(value)) <= 6 * pieces.PIECE + 1024 * 27


def test_no_encode_call_is_longer_than_a_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []

    class Watched:
        def encode(self, value: Any) -> bytes:
            encoded = msgspec.json.encode(value)
            sizes.append(len(encoded))
            return encoded

    monkeypatch.setattr(pieces, "_ENCODER", Watched())
    value = {
        "\\" * 3_000_000: ["\x01" * 1_000_000, *(["\\" * 1000] * 5000)],
        "many": [{"k": "\\" * 100}] * 20_000,
    }
    assert bytes(cast(bytearray, pieces.encode(value))) == msgspec.json.encode(value)
    # A piece of characters that all escape to six bytes, and a run's brackets.
    assert sizes and max(sizes) <= 6 * (pieces.PIECE + 1) + 2


def test_a_value_nested_deeper_than_the_walk_goes_is_encoded_whole() -> None:
    deep = msgspec.json.decode("[" * 900 + '"x"' + "]" * 900)
    whole = msgspec.json.encode(deep)
    assert bytes(cast(bytearray, pieces.encode(deep))) == whole
    assert pieces.encode(deep, limit=10) == len(whole)
