"""OpenTelemetry spans: a cell span under the caller's span, its nested calls under it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from codemode.model import CodeMode, ToolRegistry
from tests.tools.cells import run_cell

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def _provider() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)  # once per process: OpenTelemetry refuses a second


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


async def test_cells_and_nested_calls_are_spans_under_the_caller(
    exporter: InMemorySpanExporter,
) -> None:
    registry = ToolRegistry()

    @registry.tool
    async def weather(city: str) -> str:
        return f"sunny in {city}"

    @registry.tool
    def broken() -> None:
        raise ValueError("no")

    tracer = trace.get_tracer("agent")
    async with CodeMode(registry) as code_mode:
        with tracer.start_as_current_span("agent.turn"):
            run = await run_cell(
                code_mode,
                "text(await tools.weather({city: 'Oslo'}));"
                "try { await tools.broken({}) } catch (e) {}",
                call_id="call-7",
            )
            yielded = await run_cell(
                code_mode, '// @exec: {"yield_time_ms": 50}\nawait new Promise(() => {})'
            )
            await code_mode.handle_wait('{"cell_id": "2", "terminate": true}')
    assert run.success and run.texts == ["sunny in Oslo"], run.texts
    assert not yielded.texts
    spans = {
        span.name + ":" + str((span.attributes or {}).get("codemode.tool", "")): span
        for span in exporter.get_finished_spans()
    }
    turn = spans["agent.turn:"]
    cells = [span for span in exporter.get_finished_spans() if span.name == "codemode.cell"]
    assert [dict(span.attributes or {}) for span in cells] == [
        {
            "codemode.tool_call_id": "call-7",
            "codemode.cell_id": "1",
            "codemode.outcome": "completed",
        },
        {
            "codemode.tool_call_id": "call-1",
            "codemode.cell_id": "2",
            "codemode.outcome": "terminated",
        },
    ]
    assert all(
        span.parent is not None and span.parent.span_id == turn.context.span_id for span in cells
    )
    weather_span = spans["codemode.tool_call:weather"]
    broken_span = spans["codemode.tool_call:broken"]
    for call in (weather_span, broken_span):
        assert call.parent is not None and call.parent.span_id == cells[0].context.span_id
        assert call.context.trace_id == turn.context.trace_id
    assert weather_span.status.status_code is not StatusCode.ERROR
    assert broken_span.status.status_code is StatusCode.ERROR
    assert spans["codemode.wait:"].attributes == {"codemode.cell_id": "2"}


async def test_sessions_sharing_a_registry_keep_their_spans_apart(
    exporter: InMemorySpanExporter,
) -> None:
    # Guards: spans were keyed by cell id alone; with one registry serving two sessions, the
    # second session's cell "1" took the first's entry, and a later call of the first session's
    # cell "1" was no child of its cell (nor in its trace).
    registry = ToolRegistry()
    gate = asyncio.Event()

    @registry.tool
    async def wait_for_gate() -> None:
        await gate.wait()

    @registry.tool
    async def whoami(name: str) -> str:
        return name

    tracer = trace.get_tracer("agent")
    async with CodeMode(registry) as alice, CodeMode(registry) as bob:
        with tracer.start_as_current_span("agent.alice") as alice_turn:
            parked = await run_cell(
                alice,
                '// @exec: {"yield_time_ms": 100}\n'
                "await tools.wait_for_gate({}); text(await tools.whoami({name: 'alice'}))",
            )
        assert not parked.texts
        with tracer.start_as_current_span("agent.bob") as bob_turn:
            done = await run_cell(bob, "text(await tools.whoami({name: 'bob'}))")
        assert done.texts == ["bob"]
        gate.set()
        with tracer.start_as_current_span("agent.alice.wait"):
            await alice.handle_wait('{"cell_id": "1", "yield_time_ms": 10000}')
    finished = exporter.get_finished_spans()
    cells = {span.context.span_id: span for span in finished if span.name == "codemode.cell"}
    calls = [span for span in finished if span.name == "codemode.tool_call"]
    assert len(cells) == 2 and len(calls) == 3
    per_trace: dict[int, list[str]] = {}
    for call in calls:
        assert call.parent is not None and call.parent.span_id in cells, call.attributes
        assert cells[call.parent.span_id].context.trace_id == call.context.trace_id
        tool = str((call.attributes or {}).get("codemode.tool"))
        per_trace.setdefault(call.context.trace_id, []).append(tool)
    assert sorted(per_trace[alice_turn.get_span_context().trace_id]) == ["wait_for_gate", "whoami"]
    assert per_trace[bob_turn.get_span_context().trace_id] == ["whoami"]
    assert all(
        (span.attributes or {}).get("codemode.outcome") == "completed" for span in cells.values()
    )
