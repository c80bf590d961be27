"""``CodeMode``, the agent-loop facade, and the exec pragma feeding real cells (runtime.md §14-§15)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest

import codemode
from codemode.errors import CodeModeError
from codemode.model import CodeMode, CodeModeToolHandler, CustomToolInput, ToolRegistry, tool
from codemode.model.exec_tool import EXEC_GRAMMAR, wait_tool_spec
from codemode.model.registry import ToolContext, current_exec_call_id
from codemode.model.render import RenderedOutput
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    Terminated,
    WaitOutcome,
    WaitRequest,
    Yielded,
)
from codemode.runtime import LocalSession, LocalSessionProvider, NodeEngine
from codemode.session import (
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    StartedCell,
)
from tests.model.test_handler import FakeSession, ticking_clock

SHUTTING_DOWN = "code mode session is shutting down"


def clock(step: float = 0.5) -> Callable[[], float]:
    ticks = ticking_clock(step)
    return lambda: next(ticks)


def header(status: str, seconds: str = "0.5") -> InputText:
    return InputText(f"{status}\nWall time {seconds} seconds\nOutput:\n")


def exec_call(call_id: str, source: str) -> dict[str, Any]:
    return {"type": "custom_tool_call", "call_id": call_id, "name": "exec", "input": source}


def wait_call(call_id: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "wait", "arguments": arguments}


def sample_registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Echo tool")
    def echo(**arguments: Any) -> dict[str, Any]:
        return arguments

    @registry.tool(name="hidden-dynamic-tool", description="Hidden tool")
    async def hidden(city: str) -> dict[str, Any]:
        return {"ok": True, "city": city}

    @registry.tool(namespace="math")
    def mean(values: list[float]) -> float:
        """Arithmetic mean."""
        return sum(values) / len(values)

    registry.describe_namespace("math", "Arithmetic helpers.")
    return registry


class RecordingFakeSession(FakeSession):
    """The handler tests' fake session, also recording shutdown."""

    def __init__(self) -> None:
        super().__init__()
        self.shut_down = 0

    async def shutdown(self) -> None:
        self.shut_down += 1


class RecordingSession(CodeModeSession):
    """Any session: forwards to a real one and keeps the execute requests."""

    def __init__(self, inner: CodeModeSession) -> None:
        self.inner = inner
        self.requests: list[ExecuteRequest] = []

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        self.requests.append(request)
        return await self.inner.execute(request)

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        return await self.inner.wait(request)

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        return await self.inner.terminate(cell_id)

    async def shutdown(self) -> None:
        await self.inner.shutdown()


class FakeProvider(CodeModeSessionProvider):
    """Hands out one fake session and records how it was asked for it."""

    def __init__(self) -> None:
        self.session = RecordingFakeSession()
        self.opened: list[tuple[CodeModeSessionDelegate, CodeModeSessionCellExecutionLimits]] = []

    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self, delegate: CodeModeSessionDelegate, limits: CodeModeSessionCellExecutionLimits
    ) -> CodeModeSession:
        self.opened.append((delegate, limits))
        return self.session


@pytest.fixture
def fake() -> RecordingFakeSession:
    return RecordingFakeSession()


@pytest.fixture
async def with_fake(fake: RecordingFakeSession) -> AsyncIterator[CodeMode]:
    async with CodeMode(sample_registry(), session=fake, clock=clock()) as code_mode:
        yield code_mode


def node_pid(engine: NodeEngine | None) -> int:
    assert engine is not None and engine.pid is not None
    return engine.pid


async def process_gone(pid: int) -> bool:
    for _ in range(500):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.01)
    return False


# --- exports and the tool definitions ------------------------------------------------------------


def test_exported_from_the_top_level_package() -> None:
    assert codemode.CodeMode is CodeMode
    assert codemode.ToolRegistry is ToolRegistry
    assert codemode.tool is tool


def test_tools_are_exec_and_wait_in_responses_shape() -> None:
    exec_spec, wait_spec = CodeMode(sample_registry()).tools()
    assert exec_spec["type"] == "custom"
    assert exec_spec["name"] == "exec"
    assert exec_spec["format"] == {"type": "grammar", "syntax": "lark", "definition": EXEC_GRAMMAR}
    assert wait_spec == wait_tool_spec()


def test_exec_description_declares_the_registry_tools_by_default() -> None:
    description = CodeMode(sample_registry()).exec_description()
    assert "### `echo`\nEcho tool" in description
    assert "### `hidden_dynamic_tool` (`hidden-dynamic-tool`)\nHidden tool" in description
    assert "## math\nArithmetic helpers.\n\n### `math__mean`" in description
    assert "`store(key: string" in description


def test_exec_description_options() -> None:
    description = CodeMode(
        sample_registry(), code_mode_only=False, store_load=False, image_detail=False
    ).exec_description()
    assert "### `echo`" not in description
    assert "store(" not in description
    assert "codex/imageDetail" not in description


@pytest.mark.parametrize(("cap", "shown"), [(500, 500), (0, 0), (60_000, 10_000), (None, 10_000)])
def test_exec_description_gives_the_default_yield_time_the_session_limits_make(
    cap: int | None, shown: int
) -> None:
    # It said "Defaults to 10000 ms." whatever the session's max_yield_time_ms capped it to.
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=cap)
    description = CodeMode(sample_registry(), provider=FakeProvider(), limits=limits)
    assert f"early with the output so far. Defaults to {shown} ms.\n" in (
        description.exec_description()
    )
    # The wait tool's too, in every API shape (its parameter schema keeps the spec's text).
    wait = f"before yielding again (default {shown} ms).\n"
    assert wait in description.wait_description()
    assert wait in str(description.tools()[1]["description"])
    assert wait in str(description.anthropic.tools()[1]["description"])


def test_exec_description_follows_tools_registered_later() -> None:
    registry = ToolRegistry()
    code_mode = CodeMode(registry)

    @registry.tool
    def later() -> None:
        """Added after the facade."""

    assert "### `later`\nAdded after the facade." in code_mode.exec_description()


def test_tools_given_as_a_list_get_a_registry() -> None:
    @tool
    def ping() -> str:
        """Ping."""
        return "pong"

    code_mode = CodeMode([ping])
    assert code_mode.registry.definitions() == [ping.definition]


def test_conflicting_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="either an open session or a provider"):
        CodeMode(session=FakeSession(), provider=FakeProvider())
    with pytest.raises(ValueError, match="either an open session or a provider"):
        CodeMode(session=FakeSession(), limits=CodeModeSessionCellExecutionLimits(1))
    with pytest.raises(ValueError, match="on_notify to the ToolRegistry"):
        CodeMode(ToolRegistry(), on_notify=lambda *_: None)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (exec_call("c", "text(1)"), True),
        (wait_call("c", "{}"), True),
        (SimpleNamespace(type="custom_tool_call", name="exec"), True),
        ({"type": "function_call", "name": "shell"}, False),
        (SimpleNamespace(type="message"), False),
    ],
)
def test_handles_only_exec_and_wait(call: object, expected: bool) -> None:
    assert CodeMode.handles(call) is expected


# --- handling calls on any session ---------------------------------------------------------------


async def test_exec_call_becomes_a_custom_tool_call_output(
    with_fake: CodeMode, fake: RecordingFakeSession
) -> None:
    item = await with_fake.handle(exec_call("call-1", '// @exec: {"yield_time_ms": 5}\ntext(1)'))
    assert item == {
        "type": "custom_tool_call_output",
        "call_id": "call-1",
        "output": [
            {"type": "input_text", "text": "Script completed\nWall time 0.5 seconds\nOutput:\n"},
            {"type": "input_text", "text": "ok"},
        ],
    }
    assert fake.executed == [
        ExecuteRequest("call-1", "text(1)", with_fake.registry.definitions(), 5, None)
    ]


async def test_sdk_objects_are_accepted(with_fake: CodeMode, fake: RecordingFakeSession) -> None:
    call = SimpleNamespace(
        type="function_call", call_id="w-1", name="wait", arguments='{"cell_id": "4"}'
    )
    item = await with_fake.handle(call)
    assert item["type"] == "function_call_output"
    assert item["call_id"] == "w-1"
    assert fake.waited == [WaitRequest(CellId("4"), 10_000)]


async def test_exec_as_a_function_call_is_refused(with_fake: CodeMode) -> None:
    call = {"type": "function_call", "call_id": "c", "name": "exec", "arguments": "{}"}
    item = await with_fake.handle(call)
    assert item == {
        "type": "function_call_output",
        "call_id": "c",
        "output": [{"type": "input_text", "text": "exec expects raw JavaScript source text"}],
    }


async def test_wait_as_a_custom_call_is_refused(with_fake: CodeMode) -> None:
    call = {"type": "custom_tool_call", "call_id": "c", "name": "wait", "input": "{}"}
    item = await with_fake.handle(call)
    assert item["output"] == [{"type": "input_text", "text": "wait expects JSON arguments"}]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"type": "custom_tool_call", "call_id": "c", "name": "shell", "input": "ls"}, "shell"),
        ({"type": "function_call", "call_id": "c", "name": "shell"}, "not an exec or wait call"),
        ({"type": "message", "call_id": "c", "name": "exec"}, "unsupported tool call type"),
        ({"type": "custom_tool_call", "name": "exec", "input": "x"}, "`call_id`"),
        ({"type": "custom_tool_call", "call_id": "c", "name": "exec"}, "`input`"),
        ({"type": "function_call", "call_id": "c", "name": "wait"}, "`arguments`"),
    ],
)
async def test_calls_that_are_not_exec_or_wait_are_programming_errors(
    with_fake: CodeMode, fake: RecordingFakeSession, call: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await with_fake.handle(call)
    assert fake.executed == []
    assert fake.waited == []


async def test_live_cells_follow_the_outcomes(
    with_fake: CodeMode, fake: RecordingFakeSession
) -> None:
    assert with_fake.live_cells == {}
    fake.response = Yielded(CellId("1"), [])
    await with_fake.handle(exec_call("call-1", "await 0"))
    assert with_fake.live_cells == {CellId("1"): "call-1"}
    fake.outcome = LiveCell(Yielded(CellId("1"), []))
    await with_fake.handle_wait('{"cell_id": "1"}')
    assert with_fake.live_cells == {CellId("1"): "call-1"}
    fake.failure = CodeModeError("exec cell 1 already has an active observer")
    await with_fake.handle_wait('{"cell_id": "1"}')
    assert with_fake.live_cells == {CellId("1"): "call-1"}
    fake.failure = None
    fake.outcome = LiveCell(Result(CellId("1"), []))
    await with_fake.handle_wait('{"cell_id": "1"}')
    assert with_fake.live_cells == {}


async def test_wait_arguments_may_be_a_mapping_already_decoded(
    with_fake: CodeMode, fake: RecordingFakeSession
) -> None:
    fake.response = Yielded(CellId("1"), [])
    await with_fake.handle(exec_call("call-1", "await 0"))
    fake.outcome = LiveCell(Result(CellId("1"), []))
    assert (await with_fake.handle_wait({"cell_id": "1", "yield_time_ms": 10})).success
    assert with_fake.live_cells == {}
    refused = await with_fake.handle_wait({"cell_id": 1})
    assert not refused.success
    assert refused.items == [
        InputText("failed to parse function arguments: Expected `str`, got `int` - at `$.cell_id`")
    ]


@pytest.mark.parametrize(
    "outcome",
    [
        LiveCell(Terminated(CellId("1"), [])),
        MissingCell(Result(CellId("1"), [], "exec cell 1 not found")),
    ],
)
async def test_terminated_and_missing_cells_are_no_longer_live(
    with_fake: CodeMode, fake: RecordingFakeSession, outcome: WaitOutcome
) -> None:
    fake.response = Yielded(CellId("1"), [])
    await with_fake.handle_exec("call-1", "await 0")
    fake.outcome = outcome
    await with_fake.handle_wait('{"cell_id": "1", "terminate": true}')
    assert with_fake.live_cells == {}


async def test_a_given_session_is_not_shut_down_but_its_live_cells_are_terminated(
    fake: RecordingFakeSession,
) -> None:
    code_mode = CodeMode(sample_registry(), session=fake)
    fake.response = Yielded(CellId("1"), [])
    await code_mode.handle_exec("call-1", "await 0")
    fake.response = Result(CellId("2"), [])
    await code_mode.handle_exec("call-2", "text(1)")
    await code_mode.aclose()
    assert fake.terminated == [CellId("1")]
    assert fake.shut_down == 0


async def test_after_aclose_calls_fail_with_the_closed_text_or_the_sessions_own(
    fake: RecordingFakeSession,
) -> None:
    # With a session given to it (left open), a closed CodeMode said the session was shutting
    # down.
    code_mode = CodeMode(sample_registry(), session=fake)
    await code_mode.aclose()
    await code_mode.aclose()  # idempotent
    failure = RenderedOutput([InputText("code mode is closed")], success=False)
    assert await code_mode.handle_exec("call-1", "text(1)") == failure
    assert await code_mode.handle_wait('{"cell_id": "1"}') == failure
    with pytest.raises(CodeModeError, match=r"^code mode is closed$"):
        await code_mode.start()
    assert fake.executed == []
    assert fake.waited == []
    assert fake.shut_down == 0
    # A session aclose shut down gives its own text.
    provider = FakeProvider()
    code_mode = CodeMode(sample_registry(), provider=provider)
    await code_mode.handle_exec("call-1", "text(1)")
    await code_mode.aclose()
    assert provider.session.shut_down == 1
    shut_down = RenderedOutput([InputText(SHUTTING_DOWN)], success=False)
    assert await code_mode.handle_exec("call-2", "text(1)") == shut_down


async def test_a_provider_session_is_opened_lazily_with_the_registry_and_limits() -> None:
    provider = FakeProvider()
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=5)
    code_mode = CodeMode(sample_registry(), provider=provider, limits=limits)
    assert code_mode.session is None
    assert provider.opened == []
    await code_mode.handle_exec("call-1", "text(1)")
    await code_mode.handle_exec("call-2", "text(2)")
    assert provider.opened == [(code_mode.registry, limits)]
    assert code_mode.session is provider.session
    await code_mode.aclose()
    assert provider.session.shut_down == 1


# --- the embedded default -------------------------------------------------------------------------


async def test_embedded_session_is_created_lazily_and_closed() -> None:
    code_mode = CodeMode(sample_registry(), clock=clock())
    try:
        assert code_mode.session is None
        item = await code_mode.handle(exec_call("call-1", "text(JSON.stringify(ALL_TOOLS.length))"))
        assert item["output"][1] == {"type": "input_text", "text": "3"}
        session = code_mode.session
        assert isinstance(session, LocalSession)
        assert session.delegate is code_mode.registry
        pid = node_pid(session.engine)
    finally:
        await code_mode.aclose()
    assert session.engine is None or not session.engine.running
    assert await process_gone(pid)


async def test_concurrent_first_calls_share_one_session() -> None:
    async with CodeMode(sample_registry()) as code_mode:
        first, second = await asyncio.gather(
            code_mode.handle_exec("call-1", "text(1)"), code_mode.handle_exec("call-2", "text(2)")
        )
        assert first.success and second.success
        assert isinstance(code_mode.session, LocalSession)
        # Both cells ran in the one session: it numbered them 1 and 2.
        cell = await code_mode.session.execute(ExecuteRequest("call-3", "text(3)"))
        assert cell.cell_id == CellId("3")
        await cell.initial_response()


async def test_exec_yield_wait_and_missing_cell_through_the_embedded_session() -> None:
    async with CodeMode(sample_registry(), clock=clock()) as code_mode:
        source = (
            # The cell yields itself: a yield timer would race with a cold engine's start.
            '// @exec: {"yield_time_ms": 30000}\n'
            'text("tick"); yield_control(); await new Promise(r => setTimeout(r, 300)); text("tock")'
        )
        started = await code_mode.handle(exec_call("call-1", source))
        assert started["output"] == [
            {
                "type": "input_text",
                "text": "Script running with cell ID 1\nWall time 0.5 seconds\nOutput:\n",
            },
            {"type": "input_text", "text": "tick"},
        ]
        assert code_mode.live_cells == {CellId("1"): "call-1"}
        finished = await code_mode.handle(wait_call("w-1", '{"cell_id": "1"}'))
        assert finished == {
            "type": "function_call_output",
            "call_id": "w-1",
            "output": [
                {
                    "type": "input_text",
                    "text": "Script completed\nWall time 0.5 seconds\nOutput:\n",
                },
                {"type": "input_text", "text": "tock"},
            ],
        }
        assert code_mode.live_cells == {}
        missing = await code_mode.handle_wait('{"cell_id": "1"}')
        assert missing == RenderedOutput(
            [header("Script failed"), InputText("Script error:\nexec cell 1 not found")], False
        )


async def test_notifications_reach_on_notify() -> None:
    notes: list[tuple[str, CellId, str]] = []

    @tool
    def nothing() -> None:
        """Does nothing."""

    def on_notify(call_id: str, cell_id: CellId, text: str) -> None:
        notes.append((call_id, cell_id, text))

    async with CodeMode([nothing], on_notify=on_notify) as code_mode:
        rendered = await code_mode.handle_exec("call-7", 'notify("progress"); text("done")')
    assert rendered.success
    assert notes == [("call-7", CellId("1"), "progress")]


@pytest.mark.timeout(60)
async def test_a_tools_context_carries_the_exec_call_id_of_its_cell() -> None:
    # ToolContext.call_id is the nested call's own `exec-` id (runtime.md §4.4); the model's
    # exec call id, which on_notify gets, was nowhere in a tool's context.
    seen: list[tuple[str, str | None]] = []

    @tool
    def who(context: ToolContext) -> None:
        seen.append((context.call_id, context.exec_call_id))

    @tool
    async def who_async(context: ToolContext) -> None:
        seen.append((context.call_id, context.exec_call_id))

    source = (
        "await tools.who(); await tools.who_async(); yield_control();"
        "await new Promise(r => setTimeout(r, 100)); await tools.who(); text('done')"
    )
    async with CodeMode([who, who_async]) as code_mode:
        first = await code_mode.handle_exec("call-9", source)
        assert first.to_json()[0]["text"].startswith("Script running with cell ID 1")
        done = await code_mode.handle_wait('{"cell_id": "1"}')
        assert done.to_json()[-1]["text"] == "done"
        other = await code_mode.handle_exec("call-10", "await tools.who()")
        assert other.success
    assert [exec_call for _, exec_call in seen] == ["call-9", "call-9", "call-9", "call-10"]
    assert all(call_id.startswith("exec-") for call_id, _ in seen)
    assert current_exec_call_id.get() is None  # set around execute only


async def test_aclose_terminates_own_cells_in_a_given_embedded_session() -> None:
    cancelled = asyncio.Event()
    registry = ToolRegistry()

    @registry.tool
    async def block(context: ToolContext) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            # Cancelled by the registry once the token fired.
            cancelled.set()

    async with LocalSessionProvider() as provider:
        session = await provider.create_session(registry)
        code_mode = CodeMode(registry, session=session, clock=clock())
        source = '// @exec: {"yield_time_ms": 50}\nawait tools.block({})'
        rendered = await code_mode.handle_exec("call-1", source)
        assert rendered == RenderedOutput([header("Script running with cell ID 1")], True)
        await code_mode.aclose()
        assert cancelled.is_set()
        assert await session.wait(WaitRequest(CellId("1"), 10)) == MissingCell(
            Result(CellId("1"), [], "exec cell 1 not found")
        )
        # The session itself is still open for its owner.
        cell = await session.execute(ExecuteRequest("call-2", "text('still open')"))
        assert await cell.initial_response() == Result(CellId("2"), [InputText("still open")], None)


# --- the pragma feeds ExecuteRequest on a real session --------------------------------------------


@pytest.fixture
async def recording() -> AsyncIterator[tuple[RecordingSession, ToolRegistry]]:
    registry = sample_registry()

    @registry.tool
    async def slow() -> None:
        await asyncio.Event().wait()

    async with LocalSessionProvider() as provider:
        yield RecordingSession(await provider.create_session(registry)), registry


async def test_pragma_budget_and_normalized_identifier_end_to_end(
    recording: tuple[RecordingSession, ToolRegistry],
) -> None:
    session, registry = recording
    handler = CodeModeToolHandler(session, registry.definitions, clock=clock())
    code = 'const r = await tools.hidden_dynamic_tool({city: "Oslo"});\ntext(r.city + ":" + "a".repeat(100))'
    source = '// @exec: {"yield_time_ms": 60000, "max_output_tokens": 10}\n' + code
    rendered = await handler.handle_exec("call-1", CustomToolInput(source))
    assert session.requests == [ExecuteRequest("call-1", code, registry.definitions(), 60000, 10)]
    # "Oslo:" and 100 "a" are 105 bytes (27 tokens), cut to the 10-token (40-byte) budget.
    assert rendered == RenderedOutput(
        [
            header("Script completed"),
            InputText(
                "Warning: truncated output (original token count: 27)\nTotal output lines: 1\n\n"
                + "Oslo:"
                + "a" * 15
                + "…17 tokens truncated…"
                + "a" * 20
            ),
        ],
        True,
    )


async def test_pragma_yield_time_end_to_end(
    recording: tuple[RecordingSession, ToolRegistry],
) -> None:
    session, registry = recording
    handler = CodeModeToolHandler(session, registry.definitions, clock=clock())
    code = 'text("waiting"); await tools.slow({})'
    loop = asyncio.get_running_loop()
    started = loop.time()
    rendered = await handler.handle_exec("call-1", '// @exec: {"yield_time_ms": 50}\n' + code)
    # The default yield time is 10 s: yielding this soon means the pragma's 50 ms was used.
    assert loop.time() - started < 5
    assert session.requests == [ExecuteRequest("call-1", code, registry.definitions(), 50, None)]
    assert rendered == RenderedOutput(
        [header("Script running with cell ID 1"), InputText("waiting")], True
    )
    assert handler.live_cells == {CellId("1"): "call-1"}
    terminated = await handler.handle_wait('{"cell_id": "1", "terminate": true}')
    assert terminated == RenderedOutput([header("Script terminated")], True)
    assert handler.live_cells == {}


async def test_no_pragma_leaves_the_defaults_to_the_runtime(
    recording: tuple[RecordingSession, ToolRegistry],
) -> None:
    session, registry = recording
    async with CodeMode(registry, session=session) as code_mode:
        rendered = await code_mode.handle_exec(
            "call-1", "text(await tools.math__mean({values: [3]}))"
        )
    assert rendered.items[1:] == [InputText("3")]
    assert session.requests == [
        ExecuteRequest(
            "call-1", "text(await tools.math__mean({values: [3]}))", registry.definitions()
        )
    ]


async def test_a_codemode_of_its_own_runtime_runs_one_engine_process() -> None:
    # Guards: the runtime a CodeMode makes for its one session kept a second engine process warm
    # for a session that never comes (a server with a CodeMode per conversation ran two each).
    from codemode.runtime.session import REFILL_DELAY

    async with CodeMode([]) as code_mode:
        await code_mode.handle_exec("call-1", "text(1)")
        await asyncio.sleep(REFILL_DELAY + 0.3)
        provider = code_mode._owned_provider
        assert provider is not None
        assert provider.pool.engines == 1
