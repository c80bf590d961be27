"""A tool registry driving real cells through the embedded runtime (runtime.md §4.3-§4.5, §7).

Every test runs JavaScript in V8 (a real :class:`LocalSessionProvider`) and checks the exact values
and rejection strings the JavaScript sees, the registry's cancellation of abandoned calls, and the
notifications routed to the registry's callback.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from codemode.errors import CodeModeError
from codemode.model.registry import ToolContext, ToolRegistry
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ContentItem,
    ExecuteRequest,
    InputText,
    LiveCell,
    Result,
    RuntimeResponse,
    Terminated,
    ToolDefinition,
    ToolName,
    Yielded,
)
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.session import CancellationToken

UUID4 = re.compile(r"^exec-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class Report(msgspec.Struct):
    city: str
    celsius: int


@dataclass
class Probe:
    """What the tools and the notification callback observed."""

    contexts: list[ToolContext] = field(default_factory=list)
    notes: list[tuple[str, CellId, str]] = field(default_factory=list)
    slow_started: asyncio.Event = field(default_factory=asyncio.Event)
    slow_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    slow_token_fired: list[bool] = field(default_factory=list)
    grind_started: threading.Event = field(default_factory=threading.Event)
    grind_saw_token: threading.Event = field(default_factory=threading.Event)


class RecordingRegistry(ToolRegistry):
    """A registry that also keeps every call and the token it was given."""

    def __init__(self, probe: Probe) -> None:
        async def on_notify(call_id: str, cell_id: CellId, text: str) -> None:
            await asyncio.sleep(0)  # an async callback, awaited by the registry
            probe.notes.append((call_id, cell_id, text))

        super().__init__(on_notify=on_notify)
        self.calls: list[tuple[CodeModeNestedToolCall, CancellationToken]] = []

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.calls.append((invocation, cancellation))
        return await super().invoke_tool(invocation, cancellation)


def build_registry(probe: Probe) -> RecordingRegistry:
    """Sync, async, namespaced, freeform, renamed, failing and blocking tools."""
    registry = RecordingRegistry(probe)

    @registry.tool(description="Echo tool")
    def echo(**arguments: Any) -> dict[str, Any]:
        return arguments

    @registry.tool
    async def weather(city: str, context: ToolContext) -> Report:
        """Current weather of a city."""
        probe.contexts.append(context)
        await asyncio.sleep(0.01)
        return Report(city, len(city))

    @registry.tool(namespace="math")
    def mean(values: list[float]) -> float:
        """Arithmetic mean."""
        return sum(values) / len(values)

    @registry.tool(freeform=True, description="Patch tool")
    def patch(source: str) -> str:
        return "patched:" + source

    @registry.tool(name="hidden-dynamic-tool", description="Hidden tool")
    def hidden(city: str) -> dict[str, Any]:
        return {"ok": True, "city": city}

    @registry.tool
    async def fail() -> None:
        raise CodeModeError("boom")

    @registry.tool
    def explode() -> None:
        raise ValueError("kaboom")

    @registry.tool
    def add(a: int, b: int = 1) -> int:
        return a + b

    @registry.tool
    async def slow(context: ToolContext) -> str:
        probe.slow_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            probe.slow_token_fired.append(context.cancellation.is_cancelled())
            probe.slow_cancelled.set()
            raise
        return "never"

    @registry.tool
    async def until_slow_started() -> None:
        await probe.slow_started.wait()

    @registry.tool
    def grind(context: ToolContext) -> str:
        # A sync tool's thread cannot be interrupted: it has to watch its token.
        probe.grind_started.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if context.cancellation.is_cancelled():
                probe.grind_saw_token.set()
                return "stopped"
            time.sleep(0.005)
        return "timed out"

    @registry.tool
    async def until_grind_started() -> None:
        await asyncio.to_thread(probe.grind_started.wait, 5)

    return registry


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def registry(probe: Probe) -> RecordingRegistry:
    return build_registry(probe)


@pytest.fixture
async def session(registry: RecordingRegistry) -> AsyncIterator[LocalSession]:
    async with LocalSessionProvider() as provider:
        yield await provider.create_session(registry)


async def run(
    session: LocalSession,
    source: str,
    tools: list[ToolDefinition],
    *,
    call_id: str = "call-1",
    yield_time_ms: int | None = None,
) -> RuntimeResponse:
    cell = await session.execute(ExecuteRequest(call_id, source, tools, yield_time_ms))
    return await cell.initial_response()


def texts(items: list[ContentItem]) -> list[str]:
    return [item.text for item in items if isinstance(item, InputText)]


# --- values the JavaScript receives --------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # a sync tool; no argument is dispatched as {}
        (
            'text(JSON.stringify(await tools.echo({a: [1, "x"], b: null})))',
            '{"a":[1,"x"],"b":null}',
        ),
        ("text(JSON.stringify(await tools.echo()))", "{}"),
        # an async tool returning a Struct, converted to a plain object
        (
            'text(JSON.stringify(await tools.weather({city: "Oslo"})))',
            '{"city":"Oslo","celsius":4}',
        ),
        # a namespaced tool under its flat, normalized name
        ("text(String(await tools.math__mean({values: [1, 2, 6]})))", "3"),
        # a freeform tool gets the raw string
        ('text(await tools.patch("*** Begin"))', "patched:*** Begin"),
        # a name normalized to an identifier
        (
            'text(JSON.stringify(await tools.hidden_dynamic_tool({city: "Rome"})))',
            '{"ok":true,"city":"Rome"}',
        ),
        ("text(String(await tools.add({a: 2})))", "3"),
    ],
)
async def test_results_reach_javascript(
    session: LocalSession, registry: RecordingRegistry, source: str, expected: str
) -> None:
    response = await run(session, source, registry.definitions())
    assert response == Result(CellId("1"), [InputText(expected)], None)


async def test_all_tools_lists_normalized_names_in_registration_order(
    session: LocalSession, registry: RecordingRegistry
) -> None:
    source = "text(JSON.stringify(ALL_TOOLS.slice(0, 5)))"
    response = await run(session, source, registry.definitions())
    assert texts(response.content_items) == [
        '[{"name":"echo","description":"Echo tool"},'
        '{"name":"weather","description":"Current weather of a city."},'
        '{"name":"math__mean","description":"Arithmetic mean."},'
        '{"name":"patch","description":"Patch tool"},'
        '{"name":"hidden_dynamic_tool","description":"Hidden tool"}]'
    ]


async def test_parallel_calls_and_the_context_each_call_gets(
    session: LocalSession, registry: RecordingRegistry, probe: Probe
) -> None:
    source = """
        const [a, b, m] = await Promise.all([
            tools.weather({city: "Paris"}), tools.weather({city: "Lisbon"}),
            tools.math__mean({values: [2, 4]}),
        ]);
        text(`${a.city}=${a.celsius} ${b.city}=${b.celsius} mean=${m}`);
    """
    response = await run(session, source, registry.definitions())
    assert response == Result(CellId("1"), [InputText("Paris=5 Lisbon=6 mean=3")], None)
    assert [call.runtime_tool_call_id for call, _ in registry.calls] == [
        "tool-1",
        "tool-2",
        "tool-3",
    ]
    assert [call.tool_name for call, _ in registry.calls] == [
        ToolName.plain("weather"),
        ToolName.plain("weather"),
        ToolName.namespaced("math", "mean"),
    ]
    contexts = sorted(probe.contexts, key=lambda context: context.runtime_tool_call_id)
    assert [(c.cell_id, c.runtime_tool_call_id) for c in contexts] == [
        (CellId("1"), "tool-1"),
        (CellId("1"), "tool-2"),
    ]
    assert all(UUID4.match(context.call_id) for context in contexts)
    assert contexts[0].call_id != contexts[1].call_id


# --- rejections the JavaScript sees --------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "rejection"),
    [
        # tools that raise: a CodeModeError verbatim, anything else described
        ("tools.fail({})", "boom"),
        ("tools.explode({})", "tool `explode` failed: ValueError: kaboom"),
        # bad arguments: the §4.4 input rules
        ('tools.echo("x")', "tool `echo` expects a JSON object for arguments"),
        ("tools.echo([1])", "tool `echo` expects a JSON object for arguments"),
        ("tools.patch({a: 1})", "tool `patch` expects a string input"),
        ("tools.patch()", "tool `patch` expects a string input"),
        # bad arguments: validation against the type hints
        (
            'tools.add({a: "x"})',
            "invalid arguments for tool `add`: Expected `int`, got `str` - at `$.a`",
        ),
        ("tools.add({})", "invalid arguments for tool `add`: Object missing required field `a`"),
        (
            "tools.add({a: 1, c: 2})",
            "invalid arguments for tool `add`: Object contains unknown field `c`",
        ),
        (
            'tools.math__mean({values: "no"})',
            "invalid arguments for tool `math__mean`: Expected `array`, got `str` - at `$.values`",
        ),
    ],
)
async def test_rejections_are_plain_strings(
    session: LocalSession, registry: RecordingRegistry, call: str, rejection: str
) -> None:
    source = f"try {{ await {call}; text('resolved') }} catch (e) {{ text(typeof e + ': ' + e) }}"
    response = await run(session, source, registry.definitions())
    assert response == Result(CellId("1"), [InputText(f"string: {rejection}")], None)


@pytest.mark.parametrize(
    ("source", "items", "error_text"),
    [
        ("await tools.fail({})", [], "boom"),
        (
            'text("partial"); await tools.explode({})',
            ["partial"],
            "tool `explode` failed: ValueError: kaboom",
        ),
        (
            'await tools.add({a: "x"})',
            [],
            "invalid arguments for tool `add`: Expected `int`, got `str` - at `$.a`",
        ),
    ],
)
async def test_an_uncaught_rejection_fails_the_cell_with_its_text(
    session: LocalSession,
    registry: RecordingRegistry,
    source: str,
    items: list[str],
    error_text: str,
) -> None:
    response = await run(session, source, registry.definitions())
    assert response == Result(CellId("1"), [InputText(text) for text in items], error_text)


async def test_definitions_the_registry_does_not_serve(
    session: LocalSession, registry: RecordingRegistry
) -> None:
    def extra(name: str) -> ToolDefinition:
        return ToolDefinition(name, ToolName.plain(name), "", CodeModeToolKind.FUNCTION)

    source = """
        for (const name of ["ghost", "exec"]) {
            try { await tools[name]({}) } catch (e) { text(e) }
        }
    """
    response = await run(session, source, [*registry.definitions(), extra("ghost"), extra("exec")])
    assert texts(response.content_items) == [
        "tool `ghost` is not enabled in exec",
        "exec cannot invoke itself",
    ]


# --- cancelled calls -----------------------------------------------------------------------------


async def test_an_unawaited_call_is_cancelled_when_the_cell_ends(
    session: LocalSession, registry: RecordingRegistry, probe: Probe
) -> None:
    started = time.monotonic()
    response = await run(session, 'tools.slow({}); text("done")', registry.definitions())
    assert response == Result(CellId("1"), [InputText("done")], None)
    assert time.monotonic() - started < 2  # `slow` never returns on its own
    ((invocation, token),) = registry.calls
    assert invocation.tool_name == ToolName.plain("slow")
    assert token.is_cancelled()


async def test_a_running_async_tool_is_cancelled_when_the_cell_ends(
    session: LocalSession, registry: RecordingRegistry, probe: Probe
) -> None:
    source = 'tools.slow({}); await tools.until_slow_started({}); text("done")'
    response = await run(session, source, registry.definitions())
    assert response == Result(CellId("1"), [InputText("done")], None)
    # The runtime gave the cancelled task its grace period before answering: it has finished.
    assert probe.slow_cancelled.is_set()
    assert probe.slow_token_fired == [True]


async def test_a_running_sync_tool_sees_its_token_when_the_cell_ends(
    session: LocalSession, registry: RecordingRegistry, probe: Probe
) -> None:
    source = 'tools.grind({}); await tools.until_grind_started({}); text("done")'
    response = await run(session, source, registry.definitions())
    assert response == Result(CellId("1"), [InputText("done")], None)
    assert await asyncio.to_thread(probe.grind_saw_token.wait, 5)


async def test_terminating_a_cell_cancels_its_call(
    session: LocalSession, registry: RecordingRegistry, probe: Probe
) -> None:
    source = 'text("waiting"); await tools.slow({})'
    response = await run(session, source, registry.definitions(), yield_time_ms=100)
    assert response == Yielded(CellId("1"), [InputText("waiting")])
    await asyncio.wait_for(probe.slow_started.wait(), 5)
    assert await session.terminate(CellId("1")) == LiveCell(Terminated(CellId("1"), []))
    assert probe.slow_cancelled.is_set()
    assert probe.slow_token_fired == [True]


# --- notifications -------------------------------------------------------------------------------


async def test_notifications_reach_the_registry_callback(
    session: LocalSession, registry: RecordingRegistry, probe: Probe
) -> None:
    source = 'notify("hello"); notify({n: 1}); notify(7); text("sent")'
    response = await run(session, source, registry.definitions(), call_id="call-notify")
    assert response == Result(CellId("1"), [InputText("sent")], None)
    # The cell completes only after its notifications were delivered (§13.7).
    assert probe.notes == [
        ("call-notify", CellId("1"), "hello"),
        ("call-notify", CellId("1"), '{"n":1}'),
        ("call-notify", CellId("1"), "7"),
    ]


_USER: contextvars.ContextVar[str] = contextvars.ContextVar("_USER", default="nobody")


async def test_sync_async_and_inline_tools_see_the_context_of_the_exec() -> None:
    # The registry keeps what every carrier gives it: each call runs in (a copy of) the context
    # of the execute that started the cell, also in its worker thread.
    from codemode.model import CodeMode

    registry = ToolRegistry()

    @registry.tool
    def in_thread() -> str:
        return _USER.get()

    @registry.tool
    async def in_loop() -> str:
        return _USER.get()

    async with CodeMode(registry) as code_mode:
        await code_mode.start()  # the session (and its engine) opened by another "user"

        async def as_user(name: str) -> str:
            _USER.set(name)
            output = await code_mode.handle_exec(
                "call", "text(await tools.in_thread({}) + '/' + await tools.in_loop({}))"
            )
            return str(output)

        results = await asyncio.gather(as_user("alice"), as_user("bob"))
    assert "alice/alice" in results[0] and "bob/bob" in results[1], results
