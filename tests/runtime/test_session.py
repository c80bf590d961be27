"""A session's store in its engine: sent whole to each engine process, then only what changed."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from codemode.protocol import ExecuteRequest, InputText, Result
from codemode.runtime import LocalSession, LocalSessionProvider, NodeEngine
from codemode.runtime.engine import StoreUpdate
from tests.contract.delegate import RecordingDelegate

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Records the store updates of every cell a session starts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.updates: list[tuple[bool, list[tuple[str, str]]]] = []
        self.forgotten: list[int] = []
        run_cell, forget_store = NodeEngine.run_cell, NodeEngine.forget_store

        def record_run(engine: NodeEngine, *args: Any) -> int:
            store: StoreUpdate | None = args[4] if len(args) > 4 else None
            if store is not None:
                self.updates.append((store[1], sorted(store[2])))
            return run_cell(engine, *args)

        def record_forget(engine: NodeEngine, scope: int) -> None:
            self.forgotten.append(scope)
            forget_store(engine, scope)

        monkeypatch.setattr(NodeEngine, "run_cell", record_run)
        monkeypatch.setattr(NodeEngine, "forget_store", record_forget)


async def run(session: LocalSession, source: str) -> Result:
    started = await session.execute(
        ExecuteRequest(tool_call_id="c", source=source, enabled_tools=[], yield_time_ms=30_000)
    )
    result = await asyncio.wait_for(started.initial_response(), 30)
    assert isinstance(result, Result)
    return result


async def test_the_store_crosses_once_then_only_what_cells_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = Recorder(monkeypatch)
    async with LocalSessionProvider() as provider:
        session = await provider.create_session(RecordingDelegate())
        await run(session, 'store("a", 1)')
        await run(session, 'store("b", [2])')
        await run(session, 'throw "nothing stored"')
        result = await run(session, 'text(JSON.stringify([load("a"), load("b"), load("c")]))')
        assert result.content_items == [InputText("[1,[2],null]")]
        assert recorder.updates == [
            (True, []),
            (False, [("a", "1")]),
            (False, [("b", "[2]")]),
            (False, []),
        ]

        # A new engine process (this one died) gets the whole store again.
        engine = session.engine
        assert engine is not None and engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        for _ in range(500):
            if not engine.running:
                break
            await asyncio.sleep(0.01)
        result = await run(session, 'text(JSON.stringify([load("a"), load("b")]))')
        assert result.content_items == [InputText("[1,[2]]")]
        assert recorder.updates[-1] == (True, [("a", "1"), ("b", "[2]")])


async def test_a_shared_engine_forgets_the_store_of_a_session_that_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = Recorder(monkeypatch)
    async with LocalSessionProvider(shared_engine=True) as provider:
        first = await provider.create_session(RecordingDelegate())
        second = await provider.create_session(RecordingDelegate())
        await run(first, 'store("k", "first")')
        await run(second, 'store("k", "second")')
        await first.shutdown()
        assert recorder.forgotten == [first._scope]
        result = await run(second, "text(load('k'))")
        assert result.content_items == [InputText("second")]


async def test_a_cell_reads_the_store_as_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine's copy changes under a running cell, whose snapshot stays (runtime.md §6).
    async with LocalSessionProvider() as provider:
        session = await provider.create_session(RecordingDelegate())
        await run(session, 'store("k", "old")')
        started = await session.execute(
            ExecuteRequest(
                tool_call_id="c",
                source="await new Promise((r) => setTimeout(r, 300)); text(load('k'))",
                enabled_tools=[],
                yield_time_ms=30_000,
            )
        )
        await run(session, 'store("k", "new")')
        await run(session, 'store("other", 1)')  # carries the change of "k" to the engine
        result = await asyncio.wait_for(started.initial_response(), 30)
        assert isinstance(result, Result)
        assert result.content_items == [InputText("old")]
        assert (await run(session, "text(load('k'))")).content_items == [InputText("new")]
