"""A V1 host encodes a cell's long texts off its event loop (decision 0022, second addendum).

msgspec holds the GIL through one call and writes text JSON escapes at 250-500 MB/s: a tool input,
notification or output item of tens of millions of backslashes held the loop every session of a
host shares for half a second while its frame was encoded. Such a callback or answer is encoded
on a worker thread, a piece at a time (:func:`codemode.protocol.pieces.encode`), and reaches the
loop's encoder as ``msgspec.Raw``: no string the loop encodes is longer than a piece. What the
client receives is what one encode gives, in the order the cell made it.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codemode.host.grpc import _loads_in_pieces
from codemode.host.v1 import V1HostConnection
from codemode.protocol import pieces, strict_json
from codemode.protocol.constants import MAX_FRAME_BYTES
from codemode.protocol.v1 import codec
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1 import host as host_machine
from codemode.protocol.v1.messages import (
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    NotificationDelivered,
    NotificationSend,
    OperationRequest,
    SessionWait,
    ToolInvoke,
    ToolResult,
    WireError,
    WireInputText,
    WireOk,
    WireResultBody,
    WireRuntimeResponse,
    WireWaitRequest,
)
from codemode.runtime import LocalSessionProvider
from codemode.runtime.cell import MAX_BUFFERED_OUTPUT_CHARS
from tests.host.test_v1 import ECHO, serving
from tests.host.test_websocket import S1, execute, listening, open_session, open_single, started
from tests.host.test_websocket import result as ws_result
from tests.loop_encodes import LoopEncodes, watch_encoders
from tests.protocol.test_pieces import _JSON_VALUES, ALPHABET
from tests.wire import RawClient

#: Longer than a piece; every character escapes to two bytes.
LONG = "\\" * (3 * 1024 * 1024)


@contextlib.asynccontextmanager
async def opened(provider: LocalSessionProvider) -> AsyncIterator[RawClient]:
    """A raw client of a host served by ``provider``, with ``session-1`` open."""
    async with serving(provider) as served:
        client = served.client
        client.timeout = 30  # frames of tens of MB, on a loaded machine
        await client.handshake()
        await client.open()
        yield client


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> LoopEncodes:
    return watch_encoders(monkeypatch, codec)


@pytest.mark.timeout(60)
async def test_long_callbacks_and_items_are_encoded_off_the_loop_and_in_order(
    provider: LocalSessionProvider, watched: LoopEncodes
) -> None:
    source = (
        'const big = "\\\\".repeat(3 * 1024 * 1024);'
        'notify(big); notify("after");'
        "const echoed = await tools.echo({ value: big, n: [1, 2.5, null, true] });"
        "text(big); text(String(echoed === 'ok'));"
        "await yield_control();"
        "text(big + 'x');"
    )
    async with opened(provider) as client:
        cell = await client.execute(2, source, tools=(ECHO,))
        first = await client.receive()
        second = await client.receive()
        third = await client.receive()
        # In the cell's order, the long notification before the short one behind it.
        assert isinstance(first, DelegateRequestMessage)
        assert first.request == NotificationSend("call-1", cell, LONG)
        assert isinstance(second, DelegateRequestMessage)
        assert second.request == NotificationSend("call-1", cell, "after")
        assert isinstance(third, DelegateRequestMessage) and isinstance(third.request, ToolInvoke)
        assert third.request.invocation.input == {"value": LONG, "n": [1, 2.5, None, True]}
        client.send(
            DelegateResponseMessage(first.id, WireOk(NotificationDelivered())),
            DelegateResponseMessage(second.id, WireOk(NotificationDelivered())),
            DelegateResponseMessage(third.id, WireOk(ToolResult("ok"))),
        )
        initial = await client.receive()
        assert isinstance(initial, ExecuteInitialResponse)
        assert isinstance(initial.result, WireOk)
        assert initial.result.value.body.content_items == [
            WireInputText(LONG),
            WireInputText("true"),
        ]
        client.send(OperationRequest(3, SessionWait("session-1", WireWaitRequest(cell, 10_000))))
        answer: Any = None
        while getattr(answer, "id", None) != 3:  # the wait's answer, past the cell's closing
            answer = await client.receive()
        assert answer.result.value.outcome.live_cell.body.content_items == [
            WireInputText(LONG + "x")
        ]
    assert 0 < watched.longest <= pieces.PIECE


@pytest.mark.timeout(60)
async def test_a_callback_measured_too_large_is_refused_with_its_frame_length(
    provider: LocalSessionProvider, watched: LoopEncodes
) -> None:
    # 40 Mi backslashes: 80 MiB of JSON, only counted once past the frame limit.
    source = (
        "const big = '\\\\'.repeat(40 * 1024 * 1024);"
        "try { await tools.echo(big); } catch (e) { text(String(e)); }"
        "try { await tools.echo('small'); } catch (e) { text('refused: ' + String(e)); }"
    )
    async with opened(provider) as client:
        await client.execute(2, source, tools=(ECHO,))
        call = await client.receive()
        assert isinstance(call, DelegateRequestMessage) and isinstance(call.request, ToolInvoke)
        assert call.request.invocation.input == "small"  # the first was never written
        client.send(DelegateResponseMessage(call.id, WireOk(ToolResult("ok"))))
        initial = await client.receive()
    assert isinstance(initial, ExecuteInitialResponse) and isinstance(initial.result, WireOk)
    items = initial.result.value.body.content_items
    invoke = DelegateRequestMessage(
        1,
        "session-1",
        ToolInvoke(
            _invocation_with_input(call.request.invocation, msgspec.Raw(b"0"))  # measured
        ),
    )
    length = len(msgspec.json.encode(invoke)) - 1 + 2 * 40 * 1024 * 1024 + 2
    assert items[0] == WireInputText(
        f"code-mode IPC frame length {length} exceeds {MAX_FRAME_BYTES} bytes"
    )
    assert items[1:] == []  # the second call's answer was "ok": no text
    assert watched.longest <= pieces.PIECE


def _invocation_with_input(invocation: Any, value: Any) -> Any:
    return msgspec.structs.replace(invocation, input=value)


@pytest.mark.timeout(60)
async def test_an_answer_measured_too_large_is_refused_with_its_frame_length(
    provider: LocalSessionProvider, watched: LoopEncodes
) -> None:
    source = "text('ok'); text('\\\\'.repeat(40 * 1024 * 1024));"
    async with opened(provider) as client:
        await client.execute(2, source)
        answer = await client.receive()
    assert isinstance(answer, ExecuteInitialResponse)
    stand_in: list[Any] = [WireInputText("ok"), WireInputText(cast(str, msgspec.Raw(b"0")))]
    # The cell ends failed: its output passed the buffered limit with the long text.
    failed = f"exec cell output exceeds the limit of {MAX_BUFFERED_OUTPUT_CHARS} characters"
    whole = ExecuteInitialResponse(
        2, WireOk(WireRuntimeResponse(result=WireResultBody("1", stand_in, failed)))
    )
    # The long text's JSON (its backslashes doubled, its quotes) in place of its stand-in.
    length = len(msgspec.json.encode(whole)) - 1 + (2 * 40 * 1024 * 1024 + 2)
    assert answer.result == WireError(
        "code-mode host response exceeds the IPC frame limit: "
        f"code-mode IPC frame length {length} exceeds {MAX_FRAME_BYTES} bytes"
    )
    assert watched.longest <= pieces.PIECE


# -- what a client sends: a gRPC tool output parsed a piece at a time --------------------------

_OUTPUT_TEXTS = st.one_of(
    _JSON_VALUES.map(msgspec.json.encode),
    st.text(ALPHABET + '{}[],:"0123456789.eE+-tfnul ', max_size=120).map(str.encode),
    st.lists(st.text(ALPHABET, min_size=30, max_size=60), max_size=3).map(
        lambda keys: ("{" + ",".join(f"{json.dumps(k)}:1" for k in keys + keys[:1]) + "}").encode()
    ),
)


@settings(max_examples=400, deadline=None)
@given(_OUTPUT_TEXTS)
def test_a_tool_output_parsed_in_pieces_is_what_one_parse_gives(
    text: bytes,
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pieces, "PIECE", 16)
        patch.setattr(pieces, "LONG", 40)
        assert _parsed(_loads_in_pieces, text) == _parsed(strict_json.loads, text)


def _parsed(parse: Any, text: bytes) -> tuple[bool, Any]:
    """What ``parse(text)`` returns, or the text of the ``JSONError`` it raises."""
    try:
        return True, parse(text)
    except strict_json.JSONError as error:
        return False, str(error)


def test_no_parse_of_a_long_tool_output_handles_more_than_a_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes: list[int] = []

    class Watched:
        def decode(self, data: Any) -> Any:
            sizes.append(len(data))
            return msgspec.json.decode(data)

    monkeypatch.setattr(pieces, "_STRING", Watched())
    parsed: list[int] = []
    real = strict_json.loads_large

    def loads_large(data: bytes) -> Any:
        parsed.append(len(data))
        return real(data)

    monkeypatch.setattr(strict_json, "loads_large", loads_large)
    value = {"\\" * 2_000_000: ["\x01" * 1_500_000, 1, None], "b": "\\" * 3_000_000}
    assert _loads_in_pieces(msgspec.json.encode(value)) == value
    assert sizes and max(sizes) <= pieces.PIECE + 2
    assert parsed and max(parsed) < 1024


# -- a client's large frames, decoded off the loop (decision 0025, last addendum) ---------------


@dataclass
class Decodes:
    """The size of each decode call, by whether the event loop's thread made it."""

    loop: int = field(default_factory=threading.get_ident)
    on_loop: list[int] = field(default_factory=list)
    elsewhere: list[int] = field(default_factory=list)

    def note(self, data: Any) -> None:
        (self.on_loop if threading.get_ident() == self.loop else self.elsewhere).append(len(data))


class _WatchedDecoder:
    def __init__(self, decoder: Any, record: Decodes) -> None:
        self._decoder = decoder
        self._record = record

    def decode(self, data: Any) -> Any:
        self._record.note(data)
        return self._decoder.decode(data)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Decodes:
    """Every decoder a client frame can meet, watched: the host machine's typed decoder, the
    untyped one and jiter in the codec, and the pieces' string decoder."""
    record = Decodes()
    decoder = host_machine._APART_DECODER
    monkeypatch.setattr(decoder, "_decoder", _WatchedDecoder(decoder._decoder, record))
    monkeypatch.setattr(codec, "_ANY_DECODER", _WatchedDecoder(codec._ANY_DECODER, record))
    monkeypatch.setattr(pieces, "_STRING", _WatchedDecoder(pieces._STRING, record))
    loads_large = strict_json.loads_large

    def watched_loads_large(data: bytes) -> Any:
        record.note(data)
        return loads_large(data)

    monkeypatch.setattr(codec, "loads_large", watched_loads_large)
    return record


@pytest.fixture
def resolved(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the callbacks a V1 host's glue saw answered, in order."""
    ids: list[int] = []
    apply = V1HostConnection._apply

    def watched(self: V1HostConnection, event: Any) -> None:
        if isinstance(event, ev.CallbackResolved):
            ids.append(event.delegate_id)
        apply(self, event)

    monkeypatch.setattr(V1HostConnection, "_apply", watched)
    return ids


#: Two echoes at once; the text says what each returned.
_TWO_CALLS = (
    "const [a, b] = await Promise.all([tools.echo({n: 1}), tools.echo({n: 2})]);"
    "text(a.length + ' ' + b);"
)


@pytest.mark.timeout(60)
async def test_a_long_tool_result_is_decoded_off_the_loop_and_before_what_follows_it(
    provider: LocalSessionProvider, decodes: Decodes, resolved: list[int]
) -> None:
    async with opened(provider) as client:
        cell = await client.execute(2, _TWO_CALLS, tools=(ECHO,))
        first, second = await client.receive(), await client.receive()
        assert isinstance(first, DelegateRequestMessage)
        assert isinstance(second, DelegateRequestMessage)
        # One write: the small answer right behind the large one (6 MiB of JSON).
        client.send(
            DelegateResponseMessage(first.id, WireOk(ToolResult(LONG))),
            DelegateResponseMessage(second.id, WireOk(ToolResult("small"))),
        )
        initial = await client.receive()
        assert isinstance(initial, ExecuteInitialResponse), initial
        assert isinstance(initial.result, WireOk)
        assert initial.result.value.body.content_items == [WireInputText(f"{len(LONG)} small")]
        assert initial.result.value.body.cell_id == cell
    assert resolved == [first.id, second.id]
    assert decodes.elsewhere  # the long result's pieces
    assert max(decodes.on_loop) <= pieces.PIECE


@pytest.mark.timeout(60)
async def test_a_long_tool_result_over_websocket_is_decoded_off_the_loop_and_in_order(
    provider: LocalSessionProvider, decodes: Decodes, resolved: list[int]
) -> None:
    async with listening(provider) as host:
        control = await open_single(host.url)
        await open_session(control, 1)
        await control.send(execute(2, S1, _TWO_CALLS, [ECHO]))
        cell = await started(control, 2)
        first, second = await control.receive(), await control.receive()
        assert isinstance(first, DelegateRequestMessage)
        assert isinstance(second, DelegateRequestMessage)
        await control.send(
            DelegateResponseMessage(first.id, WireOk(ToolResult(LONG))),
            DelegateResponseMessage(second.id, WireOk(ToolResult("small"))),
        )
        answer = await control.receive(timeout=30)
        assert answer == ws_result(2, cell, f"{len(LONG)} small")
        await control.close()
    assert resolved == [first.id, second.id]
    assert decodes.elsewhere
    assert max(decodes.on_loop) <= pieces.PIECE
