"""Bad or unusual arguments to the session API: every carrier refuses them the same way, up front
(``codemode.protocol.arguments``), sends nothing, and stays usable (docs/python-api.md)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest

from codemode.errors import ArgumentTypeError, CodeModeError, WireConversionError
from codemode.protocol import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    LiveCell,
    MissingCell,
    Result,
    ToolDefinition,
    ToolName,
    WaitRequest,
    Yielded,
)
from codemode.runtime import InvalidLimitsError
from codemode.session import CancellationToken, CodeModeSession, CodeModeSessionDelegate
from tests.contract.conftest import Harness
from tests.contract.helpers import items, run

X1 = "out of range integral type conversion attempted"
TOOL = ToolDefinition("t", ToolName.plain("t"), "d")


# Values of the wrong type, typed Any so that the type checker lets the tests pass them.
A_STR: Any = "1"
A_DICT: Any = {"source": "1"}
NOTHING: Any = None


def request(**fields: Any) -> ExecuteRequest:
    values: dict[str, Any] = {"tool_call_id": "c", "source": 'text("ok")', "yield_time_ms": 10_000}
    values.update(fields)
    return ExecuteRequest(**values)


def tool(**fields: Any) -> ToolDefinition:
    values: dict[str, Any] = {"name": "t", "tool_name": ToolName.plain("t"), "description": "d"}
    values.update(fields)
    return ToolDefinition(**values)


async def usable(session: CodeModeSession) -> None:
    assert (await run(session, 'text("ok")')).content_items == items("ok")


async def refused(
    call: Callable[[], Awaitable[object]], kind: type[CodeModeError], message: str
) -> None:
    with pytest.raises(CodeModeError) as caught:
        await call()
    assert type(caught.value) is kind, repr(caught.value)
    assert str(caught.value) == message


async def test_integral_fields_out_of_range_or_not_int_raise_x1(harness: Harness) -> None:
    session = await harness.session()
    for value in (-1, 2**64, 10.5, True, "10"):
        bad: Any = value
        await refused(partial(session.execute, request(yield_time_ms=bad)), WireConversionError, X1)
        await refused(partial(session.wait, WaitRequest(CellId("1"), bad)), WireConversionError, X1)
    for value in (-1, 2**31, 1.0, False):
        too_many: Any = value
        await refused(
            partial(session.execute, request(max_output_tokens=too_many)), WireConversionError, X1
        )
    await refused(partial(session.wait, WaitRequest(CellId("1"), NOTHING)), WireConversionError, X1)
    # The largest values are fine (and nothing above went out: the first cell is cell 1).
    started = await session.execute(request(yield_time_ms=2**64 - 1, max_output_tokens=2**31 - 1))
    assert started.cell_id == CellId("1")
    assert await started.initial_response() == Result(CellId("1"), items("ok"), None)


async def test_wrong_python_types_raise_argument_type_error(harness: Harness) -> None:
    session = await harness.session()
    cases: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (
            lambda: session.wait(WaitRequest(A_STR, 10)),
            "WaitRequest.cell_id must be a CellId, not str",
        ),
        (lambda: session.terminate(A_STR), "cell_id must be a CellId, not str"),
        (
            lambda: session.execute(request(source=123)),
            "ExecuteRequest.source must be a str, not int",
        ),
        (
            lambda: session.execute(request(source=b'text("x")')),
            "ExecuteRequest.source must be a str, not bytes",
        ),
        (
            lambda: session.execute(request(tool_call_id=None)),
            "ExecuteRequest.tool_call_id must be a str, not NoneType",
        ),
        (
            lambda: session.execute(request(enabled_tools=None)),
            "ExecuteRequest.enabled_tools must be a list of ToolDefinition, not NoneType",
        ),
        (
            lambda: session.execute(request(enabled_tools=["t"])),
            "ExecuteRequest.enabled_tools[0] must be a ToolDefinition, not str",
        ),
        (
            lambda: session.execute(request(enabled_tools=[TOOL, tool(name=5)])),
            "ExecuteRequest.enabled_tools[1].name must be a str, not int",
        ),
        (
            lambda: session.execute(request(enabled_tools=[tool(tool_name="t")])),
            "ExecuteRequest.enabled_tools[0].tool_name must be a ToolName, not str",
        ),
        (
            lambda: session.execute(request(enabled_tools=[tool(description=None)])),
            "ExecuteRequest.enabled_tools[0].description must be a str, not NoneType",
        ),
        (
            lambda: session.execute(request(enabled_tools=[tool(kind="bogus")])),
            "ExecuteRequest.enabled_tools[0].kind must be a CodeModeToolKind, not 'bogus'",
        ),
        (
            lambda: session.execute(A_DICT),
            "execute()'s request must be an ExecuteRequest, not dict",
        ),
    ]
    for call, message in cases:
        await refused(call, ArgumentTypeError, message)
    with pytest.raises(TypeError):  # also an ordinary TypeError
        await session.wait(WaitRequest(1, 10))  # type: ignore[arg-type]
    await usable(session)


async def test_strings_and_schemas_that_cannot_be_encoded_are_refused(harness: Harness) -> None:
    session = await harness.session()
    await refused(
        lambda: session.execute(request(source='text("\ud800")')),
        WireConversionError,
        "ExecuteRequest.source contains a lone surrogate (U+D800 at index 6)",
    )
    await refused(
        lambda: session.execute(request(tool_call_id="\udc00")),
        WireConversionError,
        "ExecuteRequest.tool_call_id contains a lone surrogate (U+DC00 at index 0)",
    )
    await refused(
        lambda: session.execute(request(enabled_tools=[tool(input_schema={"a": math.nan})])),
        WireConversionError,
        "failed to encode code-mode tool input schema: nan is not a JSON number",
    )
    await refused(
        lambda: session.execute(request(enabled_tools=[tool(output_schema={"a": object()})])),
        WireConversionError,
        "failed to encode code-mode tool output schema: "
        "Encoding objects of type object is unsupported",
    )
    # Unusual but valid: a NUL in the source, escaped surrogates, an empty namespace, a name with
    # spaces and non-ASCII letters, duplicate tools, a tuple of tools, a kind given as its value.
    result = await run(session, 'text("a\x00b"); text("\\ud800".length)')
    assert result == Result(result.cell_id, items("a\x00b", "1"), None)
    odd = [
        tool(tool_name=ToolName.namespaced("", "t")),
        tool(name="a b ü", tool_name=ToolName.plain("a b ü")),
        tool(kind="freeform", input_schema="not an object"),
    ]
    started = await session.execute(
        request(source="text(ALL_TOOLS.map(t => t.name).join())", enabled_tools=(*odd, odd[0]))
    )
    response = await started.initial_response()
    assert response == Result(started.cell_id, items("t,a_b__,t,t"), None)


LIMIT_CASES: list[tuple[CodeModeSessionCellExecutionLimits, type[CodeModeError], str]] = [
    (CodeModeSessionCellExecutionLimits(-1, None), WireConversionError, X1),
    (CodeModeSessionCellExecutionLimits(2**64, None), WireConversionError, X1),
    (CodeModeSessionCellExecutionLimits(1.5, None), WireConversionError, X1),  # type: ignore[arg-type]
    (CodeModeSessionCellExecutionLimits(None, -1), WireConversionError, X1),
    (CodeModeSessionCellExecutionLimits(None, True), WireConversionError, X1),
    (
        CodeModeSessionCellExecutionLimits(None, 0),
        InvalidLimitsError,
        "invalid code-mode session execution limits: max_heap_size_bytes must be greater than 0",
    ),
    (
        {"max_yield_time_ms": 1},  # type: ignore[list-item]
        ArgumentTypeError,
        "limits must be a CodeModeSessionCellExecutionLimits, not dict",
    ),
]


async def test_bad_limits_refuse_the_session(harness: Harness) -> None:
    for limits, kind, message in LIMIT_CASES:
        await refused(partial(harness.session, limits=limits), kind, message)
    # A yield limit of 0 is valid: every observation yields at once.
    session = await harness.session(limits=CodeModeSessionCellExecutionLimits(0, None))
    started = await session.execute(request(source="await new Promise(() => {})"))
    assert await started.initial_response() == Yielded(started.cell_id, [])
    await session.terminate(started.cell_id)


async def test_empty_tool_call_id(harness: Harness) -> None:
    session = await harness.session()
    if harness.name in ("grpc", "upstream-grpc"):  # grpc.md §3: non-empty on that carrier
        await refused(
            lambda: session.execute(request(tool_call_id="")),
            CodeModeError,
            "gRPC code-mode execution failed: INVALID_ARGUMENT: "
            "code-mode tool call ID must not be empty",
        )
        await usable(session)
        return
    assert (await run(session, 'text("ok")', call_id="")).content_items == items("ok")


async def test_unknown_foreign_and_closed_session_cells(harness: Harness) -> None:
    session = await harness.session()
    other = await harness.session()
    started = await other.execute(request(source="await new Promise(() => {})", yield_time_ms=50))
    assert await started.initial_response() == Yielded(started.cell_id, [])
    missing = MissingCell(Result(CellId("1"), [], "exec cell 1 not found"))
    assert await session.wait(WaitRequest(started.cell_id, 10)) == missing
    assert await session.terminate(started.cell_id) == missing
    assert await session.terminate(CellId("")) == MissingCell(
        Result(CellId(""), [], "exec cell  not found")
    )
    assert isinstance(await other.terminate(started.cell_id), LiveCell)
    await session.shutdown()
    for call in (
        lambda: session.execute(request()),
        lambda: session.wait(WaitRequest(CellId("1"), 10)),
        lambda: session.terminate(CellId("1")),
    ):
        await refused(call, CodeModeError, "code mode session is shutting down")
    # A bad argument is refused as such even after shutdown (it is checked first).
    await refused(
        lambda: session.terminate(A_STR), ArgumentTypeError, "cell_id must be a CellId, not str"
    )
    await session.shutdown()


class Misbehaving(CodeModeSessionDelegate):
    def __init__(self) -> None:
        self.closed: list[str] = []

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        arguments = invocation.input
        kind = arguments["kind"]
        if kind == "nan":
            return {"x": math.nan}
        if kind == "slots":
            return Slotted()
        if kind == "raise":
            raise KeyError("k")
        return arguments

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        raise ValueError("notify failed")

    def cell_closed(self, cell_id: CellId) -> None:
        self.closed.append(str(cell_id))
        raise RuntimeError("cell_closed failed")


class Slotted:
    __slots__ = ("a",)


async def test_misbehaving_delegate(harness: Harness) -> None:
    delegate = Misbehaving()
    session = await harness.session(delegate)
    source = (
        'for (const kind of ["nan", "slots", "raise", "ok"]) {'
        "  try { text(JSON.stringify(await tools.t({kind}))) } catch (e) { text(String(e)) } }"
        'notify("hello"); text("after notify")'
    )
    tools = [tool(kind=CodeModeToolKind.FUNCTION)]
    result = await run(session, source, tools=tools)
    assert result.content_items == items(
        "code-mode delegate returned a value that is not JSON: nan is not a JSON number",
        "code-mode delegate returned a value that is not JSON: "
        "Encoding objects of type Slotted is unsupported",
        "code-mode delegate task failed: 'k'",
        '{"kind":"ok"}',
        "after notify",
    )
    # cell_closed raised: logged, and the session goes on.
    await usable(session)
    assert "1" in delegate.closed
