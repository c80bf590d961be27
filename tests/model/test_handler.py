"""Serving exec/wait calls (runtime.md §15.1-§15.4) and the pragma cases P01-P18 (§16.3)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from codemode.errors import CodeModeError
from codemode.model.handler import (
    CodeModeToolHandler,
    CustomToolInput,
    FunctionToolArguments,
)
from codemode.model.render import RenderedOutput
from codemode.protocol.types import (
    CellId,
    ExecuteRequest,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    RuntimeResponse,
    ToolCallSite,
    ToolDefinition,
    ToolName,
    WaitOutcome,
    WaitRequest,
    Yielded,
)
from codemode.session import CodeModeSession, StartedCell

P1 = (
    "exec expects raw JavaScript source text (non-empty). Provide JS only, optionally with "
    'first-line `// @exec: {"yield_time_ms": 10000, "max_output_tokens": 1000}`.'
)
P2 = "exec pragma must be followed by JavaScript source on subsequent lines"
P3 = (
    "exec pragma must be a JSON object with supported fields `yield_time_ms` and "
    "`max_output_tokens`"
)
P4 = (
    "exec pragma must be valid JSON with supported fields `yield_time_ms` and `max_output_tokens`: "
)
P6 = (
    "exec pragma fields `yield_time_ms` and `max_output_tokens` must be non-negative safe "
    "integers: "
)
TOOLS = [ToolDefinition("echo", ToolName.plain("echo"), "Echo tool")]


class FakeSession(CodeModeSession):
    """Records requests; answers with canned responses or failures."""

    def __init__(self) -> None:
        self.executed: list[ExecuteRequest] = []
        self.waited: list[WaitRequest] = []
        self.terminated: list[CellId] = []
        self.response: RuntimeResponse = Result(CellId("1"), [InputText("ok")])
        self.outcome: WaitOutcome = LiveCell(Result(CellId("1"), [InputText("done")]))
        self.failure: CodeModeError | None = None
        self.initial_failure: CodeModeError | None = None

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        if self.failure is not None:
            raise self.failure
        self.executed.append(request)
        return StartedCell.from_awaitable(CellId("1"), self._initial())

    async def _initial(self) -> RuntimeResponse:
        if self.initial_failure is not None:
            raise self.initial_failure
        return self.response

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        if self.failure is not None:
            raise self.failure
        self.waited.append(request)
        return self.outcome

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        if self.failure is not None:
            raise self.failure
        self.terminated.append(cell_id)
        return self.outcome

    async def shutdown(self) -> None:
        return None


def ticking_clock(step: float) -> Iterator[float]:
    now = 100.0
    while True:
        yield now
        now += step


@pytest.fixture
def session() -> FakeSession:
    return FakeSession()


def handler_for(session: FakeSession, step: float = 1.25) -> CodeModeToolHandler:
    clock = ticking_clock(step)
    return CodeModeToolHandler(session, TOOLS, clock=lambda: next(clock))


def failure(message: str) -> RenderedOutput:
    return RenderedOutput([InputText(message)], success=False)


@pytest.mark.parametrize(
    ("source", "code", "yield_time_ms", "max_output_tokens"),
    [
        ("text('hi')", "text('hi')", None, None),  # P01
        ("// @exec: {\"yield_time_ms\": 10}\ntext('hi')", "text('hi')", 10, None),  # P02
        (
            '  // @exec: {"yield_time_ms": 5, "max_output_tokens": 20}\r\ntext(1)',
            "text(1)",
            5,
            20,
        ),  # P03
        (
            'text(1)\n// @exec: {"yield_time_ms": 5}',
            'text(1)\n// @exec: {"yield_time_ms": 5}',
            None,
            None,
        ),  # P04
        (
            '// @exec: {"yield_time_ms": 9007199254740991, "max_output_tokens": null}\ntext(1)',
            "text(1)",
            9007199254740991,
            None,
        ),  # P15
        ("// @exec: {}\ntext(1)", "text(1)", None, None),  # P16
        (
            '//@exec: {"yield_time_ms": 5}\ntext(1)',
            '//@exec: {"yield_time_ms": 5}\ntext(1)',
            None,
            None,
        ),  # P17
        ('// @exec: {"yield_time_ms": 5}\n\ntext(1)\n', "\ntext(1)\n", 5, None),  # P18
    ],
)
async def test_pragma_values_reach_the_execute_request(
    session: FakeSession,
    source: str,
    code: str,
    yield_time_ms: int | None,
    max_output_tokens: int | None,
) -> None:
    rendered = await handler_for(session).handle_exec("call-1", CustomToolInput(source))
    assert rendered.success
    (request,) = session.executed
    assert request == ExecuteRequest("call-1", code, TOOLS, yield_time_ms, max_output_tokens)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("", P1),  # P05
        ("  \n\t ", P1),
        ('// @exec: {"yield_time_ms": 5}', P2),  # P06
        ("// @exec: {}\n  \n", P2),
        ("// @exec:\ntext(1)", P3),  # P07
        ("// @exec: [1]\ntext(1)", P3),  # P08
        (
            '// @exec: {"timeout": 5}\ntext(1)',
            "exec pragma only supports `yield_time_ms` and `max_output_tokens`; got `timeout`",
        ),  # P10
        (
            '// @exec: {"max_output_tokens": 9007199254740992}\ntext(1)',
            "exec pragma field `max_output_tokens` must be a non-negative safe integer",
        ),  # P13
        (
            '// @exec: {"yield_time_ms": 9007199254740992}\ntext(1)',
            "exec pragma field `yield_time_ms` must be a non-negative safe integer",
        ),  # P14
    ],
)
async def test_pragma_errors_are_returned_verbatim_and_create_no_cell(
    session: FakeSession, source: str, message: str
) -> None:
    assert await handler_for(session).handle_exec("call-1", source) == failure(message)
    assert session.executed == []


@pytest.mark.parametrize(
    ("source", "prefix"),
    [
        ("// @exec: {yield_time_ms: 5}\ntext(1)", P4),  # P09
        ('// @exec: {"yield_time_ms": -1}\ntext(1)', P6),  # P11
        ('// @exec: {"yield_time_ms": 1.5}\ntext(1)', P6),
        ('// @exec: {"yield_time_ms": 1e3}\ntext(1)', P6),
        ('// @exec: {"yield_time_ms": "5"}\ntext(1)', P6),
        ('// @exec: {"yield_time_ms": true}\ntext(1)', P6),
        ('// @exec: {"yield_time_ms": 18446744073709551616}\ntext(1)', P6),  # P12
    ],
)
async def test_pragma_errors_with_parser_detail(
    session: FakeSession, source: str, prefix: str
) -> None:
    rendered = await handler_for(session).handle_exec("call-1", source)
    assert not rendered.success
    (item,) = rendered.items
    assert isinstance(item, InputText)
    assert item.text.startswith(prefix)
    assert session.executed == []


async def test_exec_rejects_a_function_payload(session: FakeSession) -> None:
    rendered = await handler_for(session).handle_exec("call-1", FunctionToolArguments("{}"))
    assert rendered == failure("exec expects raw JavaScript source text")
    assert session.executed == []


async def test_exec_renders_the_initial_response_with_the_pragma_budget(
    session: FakeSession,
) -> None:
    session.response = Yielded(CellId("3"), [InputText("a" * 100)])
    source = '// @exec: {"max_output_tokens": 10}\ntext("a".repeat(100))'
    rendered = await handler_for(session).handle_exec("call-1", source)
    assert rendered.success
    assert rendered.items == [
        InputText("Script running with cell ID 3\nWall time 1.3 seconds\nOutput:\n"),
        InputText(
            "Warning: truncated output (original token count: 25)\nTotal output lines: 1\n\n"
            + "a" * 20
            + "…15 tokens truncated…"
            + "a" * 20
        ),
    ]


async def test_exec_tools_may_be_computed_per_call(session: FakeSession) -> None:
    handler = CodeModeToolHandler(session, lambda: TOOLS)
    await handler.handle_exec("call-9", "text(1)")
    assert session.executed[0].enabled_tools == TOOLS


@pytest.mark.parametrize("initial", [False, True])
async def test_exec_transport_failures_are_verbatim(session: FakeSession, initial: bool) -> None:
    error = CodeModeError("code mode session is shutting down")
    if initial:
        session.initial_failure = error
    else:
        session.failure = error
    rendered = await handler_for(session).handle_exec("call-1", "text(1)")
    assert rendered == failure("code mode session is shutting down")


async def test_wait_waits_with_defaults(session: FakeSession) -> None:
    rendered = await handler_for(session, 0.5).handle_wait('{"cell_id": "1"}')
    assert session.waited == [WaitRequest(CellId("1"), 10_000)]
    assert rendered == RenderedOutput(
        [InputText("Script completed\nWall time 0.5 seconds\nOutput:\n"), InputText("done")],
        True,
    )


async def test_wait_passes_yield_time_and_budget(session: FakeSession) -> None:
    session.outcome = LiveCell(Result(CellId("4"), [InputText("x" * 30), InputText("y" * 30)]))
    payload = FunctionToolArguments('{"cell_id": "4", "yield_time_ms": 25, "max_tokens": 10}')
    rendered = await handler_for(session).handle_wait(payload)
    assert session.waited == [WaitRequest(CellId("4"), 25)]
    assert rendered.items[1] == InputText(
        "Warning: truncated output (original token count: 16)\nTotal output lines: 2\n\n"
        + "x" * 20
        + "…6 tokens truncated…"
        + "y" * 20
    )


async def test_wait_terminate(session: FakeSession) -> None:
    await handler_for(session).handle_wait('{"cell_id": "2", "terminate": true}')
    assert session.terminated == [CellId("2")]
    assert session.waited == []


async def test_wait_on_a_missing_cell_fails(session: FakeSession) -> None:
    session.outcome = MissingCell(Result(CellId("9"), [], "exec cell 9 not found"))
    rendered = await handler_for(session, 0.0).handle_wait('{"cell_id": "9"}')
    assert rendered == RenderedOutput(
        [
            InputText("Script failed\nWall time 0.0 seconds\nOutput:\n"),
            InputText("Script error:\nexec cell 9 not found"),
        ],
        False,
    )


async def test_wait_argument_errors(session: FakeSession) -> None:
    rendered = await handler_for(session).handle_wait('{"cell_id": "1", "yield_time_ms": 1.5}')
    assert not rendered.success
    (item,) = rendered.items
    assert isinstance(item, InputText)
    assert item.text.startswith("failed to parse function arguments: ")
    assert session.waited == []


async def test_wait_rejects_a_freeform_payload(session: FakeSession) -> None:
    rendered = await handler_for(session).handle_wait(CustomToolInput('{"cell_id": "1"}'))
    assert rendered == failure("wait expects JSON arguments")


async def test_wait_transport_failure_is_verbatim(session: FakeSession) -> None:
    session.failure = CodeModeError("exec cell 1 already has an active observer")
    rendered = await handler_for(session).handle_wait('{"cell_id": "1"}')
    assert rendered == failure("exec cell 1 already has an active observer")


# -- error positions in the lines the model wrote --------------------------------------------------

ERROR_AT_ENGINE_LINE_2 = "TypeError: boom\n    at exec_main.mjs:2:6\n    at exec_main.mjs:1:1"


async def test_error_lines_count_the_pragma_line(session: FakeSession) -> None:
    session.response = Result(
        CellId("1"), [InputText("printed exec_main.mjs:2:6")], ERROR_AT_ENGINE_LINE_2
    )
    rendered = await handler_for(session).handle_exec(
        "call-1", '// @exec: {"yield_time_ms": 5}\ntext(1)\nnull.x'
    )
    text = "".join(item.text for item in rendered.items if isinstance(item, InputText))
    assert "at exec_main.mjs:3:6\n    at exec_main.mjs:2:1" in text
    assert "printed exec_main.mjs:2:6" in text  # what the cell printed is left alone
    assert session.executed[0].source == "text(1)\nnull.x"  # the request is as pinned


async def test_a_failed_tool_call_s_line_counts_the_pragma_line(session: FakeSession) -> None:
    session.response = Result(CellId("1"), [], "boom", failed_call=ToolCallSite("fail", 2, 7))
    rendered = await handler_for(session).handle_exec(
        "call-1", '// @exec: {"yield_time_ms": 5}\ntext(1)\nawait tools.fail({})'
    )
    assert rendered.items[-1] == InputText(
        "Script error:\nboom\n    at tools.fail (exec_main.mjs:3:7)"
    )


async def test_without_a_pragma_error_lines_are_the_engine_s(session: FakeSession) -> None:
    session.response = Result(CellId("1"), [], ERROR_AT_ENGINE_LINE_2)
    rendered = await handler_for(session).handle_exec("call-1", "text(1)\nnull.x")
    text = "".join(item.text for item in rendered.items if isinstance(item, InputText))
    assert "at exec_main.mjs:2:6" in text


async def test_a_yielded_cell_s_later_error_counts_the_pragma_line(session: FakeSession) -> None:
    session.response = Yielded(CellId("1"), [])
    handler = handler_for(session)
    await handler.handle_exec("call-1", '// @exec: {"yield_time_ms": 5}\nawait 0;\nnull.x')
    session.outcome = LiveCell(Result(CellId("1"), [], ERROR_AT_ENGINE_LINE_2))
    rendered = await handler.handle_wait('{"cell_id": "1"}')
    text = "".join(item.text for item in rendered.items if isinstance(item, InputText))
    assert "at exec_main.mjs:3:6" in text
    # The cell ended: a later cell with the same id starts from the engine's lines again.
    rendered = await handler.handle_wait('{"cell_id": "1"}')
    text = "".join(item.text for item in rendered.items if isinstance(item, InputText))
    assert "at exec_main.mjs:2:6" in text
