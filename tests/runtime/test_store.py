"""The store of the embedded runtime: kept in the engine process, read as a snapshot.

A small store is given to each cell whole; a larger one (past host.js's WHOLE_STORE_CHARS) is
fetched key by key. Every behaviour here holds for both.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    InputText,
    Result,
    ToolDefinition,
    ToolName,
)
from codemode.runtime import LocalSession, LocalSessionProvider, engine
from codemode.session import CancellationToken, CodeModeSessionDelegate

#: A store of a few characters, and one past what host.js gives a cell whole (64 Ki).
SIZES = {"small": 0, "large": 80 * 1024}
GATE = ToolDefinition("gate", ToolName.plain("gate"), "waits", CodeModeToolKind.FUNCTION)


class _Gate(CodeModeSessionDelegate):
    """Holds every call of ``gate`` until :attr:`opened` is set."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.opened = asyncio.Event()

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.called.set()
        await self.opened.wait()
        return None


async def run(session: LocalSession, source: str) -> list[Any]:
    started = await session.execute(ExecuteRequest(tool_call_id="c", source=source))
    response = await asyncio.wait_for(started.initial_response(), 30)
    assert isinstance(response, Result), response
    assert response.error_text is None, response.error_text
    return [item.text for item in response.content_items if isinstance(item, InputText)]


async def padded(session: LocalSession, size: str) -> None:
    """Stores ``pad`` to bring the session's store to ``size``."""
    await run(session, f"store('pad', 'p'.repeat({SIZES[size]}))")


@pytest.mark.parametrize("size", SIZES)
async def test_a_cell_reads_the_store_as_it_was_when_it_started(
    provider: LocalSessionProvider, size: str
) -> None:
    delegate = _Gate()
    session = await provider.create_session(delegate)
    await padded(session, size)
    await run(session, "store('k', 1); store('gone', 'x')")
    early = await session.execute(
        ExecuteRequest(
            tool_call_id="a",
            source="store('own', 'mine'); await tools.gate({});"
            "text(JSON.stringify([load('k'), load('new'), load('own'), load('gone')]))",
            enabled_tools=[GATE],
            yield_time_ms=30_000,
        )
    )
    await asyncio.wait_for(delegate.called.wait(), 30)
    assert await run(session, "store('k', 2); store('new', true); store('gone', null)") == []
    delegate.opened.set()
    response = await asyncio.wait_for(early.initial_response(), 30)
    assert isinstance(response, Result)
    assert response.content_items == [InputText('[1,null,"mine","x"]')]
    assert await run(
        session, "text(JSON.stringify([load('k'), load('new'), load('own'), load('gone')]))"
    ) == ['[2,true,"mine",null]']


@pytest.mark.parametrize("size", SIZES)
async def test_the_store_outlives_the_engine_process(size: str) -> None:
    async with LocalSessionProvider(shared_engine=True) as shared:
        session = await shared.create_session(CodeModeSessionDelegate())
        await padded(session, size)
        await run(session, "store('k', [1, 2])")
        assert session.engine is not None and session.engine.pid is not None
        os.kill(session.engine.pid, signal.SIGKILL)
        for _ in range(500):
            if not session.engine.running:
                break
            await asyncio.sleep(0.01)
        assert await run(session, "text(JSON.stringify(load('k')))") == ["[1,2]"]


@pytest.mark.parametrize("size", SIZES)
async def test_sessions_of_one_engine_keep_their_stores_apart(size: str) -> None:
    async with LocalSessionProvider(shared_engine=True) as shared:
        first = await shared.create_session(CodeModeSessionDelegate())
        second = await shared.create_session(CodeModeSessionDelegate())
        await padded(first, size)
        await run(first, "store('k', 'first')")
        await run(second, "store('other', 1)")
        assert await run(second, "text(String(load('k')))") == ["undefined"]
        assert await run(first, "text(load('k'))") == ["first"]
        await first.shutdown()
        third = await shared.create_session(CodeModeSessionDelegate())
        assert await run(third, "text(String(load('k')) + load('other'))") == ["undefinedundefined"]
        assert await run(second, "text(load('other'))") == ["1"]


async def test_a_store_larger_than_a_cells_heap_limit_is_still_read(
    provider: LocalSessionProvider,
) -> None:
    # Each cell writes 8 Mi characters within its 16 MiB heap; the store grows past what one
    # such cell could hold, and later cells still start and read a key of it.
    limits = CodeModeSessionCellExecutionLimits(max_heap_size_bytes=16 * 1024 * 1024)
    session = await provider.create_session_with_limits(CodeModeSessionDelegate(), limits)
    for index in range(3):
        await run(session, f"store('k{index}', 'x'.repeat(8 * 1024 * 1024))")
    assert await run(session, "text(load('k2').length)") == [str(8 * 1024 * 1024)]
    assert await run(session, "text(String(load('absent')))") == ["undefined"]


def recorded_engine_messages(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every message Python sends to an engine from now on, in order (they are still sent)."""
    sent: list[dict[str, Any]] = []
    original = engine.NodeEngine._send

    def record(self: engine.NodeEngine, message: Any) -> None:
        sent.append(message)
        original(self, message)

    monkeypatch.setattr(engine.NodeEngine, "_send", record)
    return sent


async def test_an_exec_carries_no_store_and_a_commit_sends_only_its_writes(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = recorded_engine_messages(monkeypatch)
    session = await provider.create_session(CodeModeSessionDelegate())
    await run(session, "store('big', 'b'.repeat(100000))")
    sent.clear()
    await run(session, "store('small', 1)")
    await run(session, "text(load('big').length + load('small'))")
    # The engine that sent the writes applies them to its copy when told (they are not sent
    # back): the commit carries neither them nor the rest of the store.
    commits = [message for message in sent if message["t"] in ("store", "commit")]
    assert commits == [{"t": "commit", "cell": commits[0]["cell"], "scope": commits[0]["scope"]}]
    for message in sent:
        if message["t"] == "exec":
            assert len(message["config"]) < 200, message["config"]


async def test_writes_the_engine_keeps_are_committed_or_dropped_there(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine keeps the writes of each `done` it sent until Python names them: committed
    # ones are applied to its copy of the store, refused ones forgotten (not kept for ever).
    from codemode.runtime import session as session_module

    sent = recorded_engine_messages(monkeypatch)
    monkeypatch.setattr(session_module, "MAX_STORE_CHARS", 1000)
    session = await provider.create_session(CodeModeSessionDelegate())
    await run(session, "store('a', 'x'.repeat(600))")
    started = await session.execute(
        ExecuteRequest(tool_call_id="c", source="store('b', 'x'.repeat(600))")
    )
    refused = await asyncio.wait_for(started.initial_response(), 30)
    assert isinstance(refused, Result) and refused.error_text is not None  # past the store's bound
    assert [message["t"] for message in sent if message["t"] in ("commit", "drop")] == [
        "commit",
        "drop",
    ]
    assert await run(session, "text(load('a').length + ' ' + load('b'))") == ["600 undefined"]
    assert session.engine is not None and not session.engine._held_writes


async def test_a_large_store_reaches_a_new_engine_in_many_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine, "STORE_CHUNK_CHARS", 1000)
    async with LocalSessionProvider(idle_engine_timeout=0.05) as quick:
        session = await quick.create_session(CodeModeSessionDelegate())
        await run(session, "for (let i = 0; i < 500; i++) store('k' + i, 'v'.repeat(i * 10))")
        first = session.engine
        for _ in range(500):
            if session.engine is None:
                break
            await asyncio.sleep(0.01)
        assert session.engine is None
        total = sum(len("v" * (i * 10)) + 2 for i in range(500))
        source = (
            "let n = 0; for (let i = 0; i < 500; i++) n += JSON.stringify(load('k' + i)).length;"
            "text(n)"
        )
        assert await run(session, source) == [str(total)]
        assert session.engine is not first


async def test_a_cell_stopped_while_it_fetches_keys_leaves_its_engine_running(
    provider: LocalSessionProvider,
) -> None:
    # The isolate is disposed while its thread waits in (or between) synchronous fetches from
    # the engine's main thread: the engine lives on, and so does the session's store.
    session = await provider.create_session(CodeModeSessionDelegate())
    await padded(session, "large")
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c",
            source="text('looping'); for (let i = 0; ; i++) load('absent' + i)",
            yield_time_ms=200,
        )
    )
    first = await asyncio.wait_for(started.initial_response(), 30)
    assert first.content_items == [InputText("looping")]
    assert session.engine is not None
    pid = session.engine.pid
    await asyncio.wait_for(session.terminate(started.cell_id), 30)
    assert await run(session, "text(String(load('pad').length))") == [str(SIZES["large"])]
    assert session.engine.pid == pid
