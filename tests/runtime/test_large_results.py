"""A tool's large result reaches its cell without a long encode on the event loop (decision 0025,
addendum: what a client can make a host do).

A client answers a tool call with any JSON value up to a frame's size: tens of millions of
backslashes once took an encode of the value, then of the results text that carries it to the
engine (escaped again), all on the loop every session of a host shares (about a second). A heavy
result is written on a worker thread a piece at a time; the loop only copies it into the frame.
"""

from __future__ import annotations

import math
from typing import Any, cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codemode.errors import CodeModeError
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    ExecuteRequest,
    InputText,
    Result,
    ToolDefinition,
    ToolName,
    pieces,
)
from codemode.protocol.delegation import tool_result_json
from codemode.protocol.v1 import codec
from codemode.runtime import LocalSessionProvider, engine
from codemode.runtime.engine import result_frame
from codemode.session import CancellationToken, CodeModeSessionDelegate
from tests.loop_encodes import watch_encoders
from tests.protocol.test_pieces import _JSON_VALUES, ALPHABET

BIG = ToolDefinition(
    name="big", tool_name=ToolName("big"), description="d", input_schema={"type": "object"}
)


class _Answers(CodeModeSessionDelegate):
    def __init__(self, value: JSON) -> None:
        self.value = value

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        return self.value


async def _run(provider: LocalSessionProvider, value: JSON, source: str) -> str:
    session = await provider.create_session(_Answers(value))
    try:
        started = await session.execute(
            ExecuteRequest(
                tool_call_id="t", source=source, enabled_tools=[BIG], yield_time_ms=60_000
            )
        )
        response = await started.initial_response()
        assert isinstance(response, Result), response
        assert response.error_text is None, response.error_text
        return "".join(i.text for i in response.content_items if isinstance(i, InputText))
    finally:
        await session.shutdown()


@pytest.mark.timeout(60)
async def test_a_long_result_reaches_its_cell_encoded_off_the_loop(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    watched = watch_encoders(monkeypatch, codec)
    value = {"s": '\\"\x01é😀' * 600_000, "n": [1, 2.5, None, True, "x"]}
    source = (
        "const r = await tools.big({});"
        "text(String(r.s.length) + ' ' + r.s.slice(0, 6) + ' ' + JSON.stringify(r.n))"
    )
    assert await _run(provider, value, source) == (
        f'{len(cast(dict[str, Any], value)["s"]) + 600_000} \\"\x01é😀 [1,2.5,null,true,"x"]'
    )
    # The engine's frame for it held the results text already encoded (a Raw), nothing longer
    # than a piece for the loop's encoder.
    assert watched.longest <= pieces.PIECE


@pytest.mark.timeout(60)
async def test_a_heavy_result_that_is_not_json_fails_the_call_as_before(
    provider: LocalSessionProvider,
) -> None:
    value: JSON = cast(JSON, ["x" * (pieces.PIECE + 1), math.inf])
    with pytest.raises(CodeModeError) as refused:
        tool_result_json(value)
    source = "try { await tools.big({}) } catch (e) { text(String(e.message ?? e)) }"
    assert refused.value.message in await _run(provider, value, source)


@pytest.mark.usefixtures("small")
@settings(max_examples=300, deadline=None)
@given(st.text(ALPHABET + "\x00\x7f", max_size=40), _JSON_VALUES)
def test_the_result_frame_is_what_the_engine_flush_writes(call_id: str, value: Any) -> None:
    text = msgspec.json.encode([(call_id, True, msgspec.Raw(tool_result_json(value)))]).decode()
    flushed = codec.encode_frame([{"t": "results", "cell": 7, "r": text}])
    assert bytes(result_frame(7, call_id, value)) == bytes(flushed)


@pytest.mark.usefixtures("small")
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=5))
def test_a_value_that_is_not_json_is_refused_with_the_same_text(value: list[float]) -> None:
    assert _refusal(lambda: result_frame(1, "c", value)) == _refusal(
        lambda: tool_result_json(value)
    )


def _refusal(encode: Any) -> str | None:
    """The text of the ``CodeModeError`` ``encode()`` raises (``None``: it encoded)."""
    try:
        encode()
    except CodeModeError as error:
        return error.message
    return None


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "PIECE", 16)
    monkeypatch.setattr(pieces, "LONG", 40)
    monkeypatch.setattr(engine, "STORE_PIECE_CHARS", 16)
