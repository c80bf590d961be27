"""How many engine processes a provider runs: bounded, idle ones taken back, closed sessions let go.

Each session runs its cells in an engine process of its own; without a bound a client opening
sessions in a loop would start processes until the host ran out of memory.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.errors import CodeModeError, EngineLimitError
from codemode.protocol import ExecuteRequest, InputText, Result, Yielded
from codemode.protocol.grpc import texts as grpc_texts
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.runtime.session import too_many_engines
from codemode.session import CodeModeSession, CodeModeSessionDelegate

PARK = "await new Promise(() => {})"


async def run(session: CodeModeSession, source: str) -> Result:
    started = await session.execute(ExecuteRequest(tool_call_id="c", source=source))
    response = await asyncio.wait_for(started.initial_response(), 10)
    assert isinstance(response, Result), response
    return response


async def park(session: CodeModeSession) -> None:
    """A cell that never ends: its session's engine stays busy."""
    started = await session.execute(
        ExecuteRequest(tool_call_id="c", source=PARK, yield_time_ms=100)
    )
    assert isinstance(await asyncio.wait_for(started.initial_response(), 10), Yielded)


async def test_a_cell_that_finds_every_engine_busy_is_refused_and_the_next_one_runs() -> None:
    async with LocalSessionProvider(max_engines=2, warm_engines=0) as provider:
        first, second, third = [
            await provider.create_session(CodeModeSessionDelegate()) for _ in range(3)
        ]
        await park(first)
        await park(second)
        with pytest.raises(EngineLimitError) as refused:
            await third.execute(ExecuteRequest(tool_call_id="c", source="text(1)"))
        assert refused.value.message == too_many_engines(2)
        assert provider.pool.engines <= 2
        # Nothing was lost: once a cell ends, its session's engine is free to take back.
        cell_ids = list(first._cells)
        await asyncio.wait_for(first.terminate(cell_ids[0]), 10)
        assert (await run(third, "text(3)")).content_items == [InputText("3")]
        assert provider.pool.engines <= 2


async def test_idle_sessions_give_their_engines_back_and_keep_their_stores() -> None:
    async with LocalSessionProvider(max_engines=2, warm_engines=0) as provider:
        sessions = [await provider.create_session(CodeModeSessionDelegate()) for _ in range(5)]
        for index, session in enumerate(sessions):
            await run(session, f"store('k', {index})")
            assert provider.pool.engines <= 2
        for index, session in enumerate(sessions):
            result = await run(session, "text(load('k'))")
            assert result.content_items == [InputText(str(index))]
            assert provider.pool.engines <= 2


async def test_opening_a_session_takes_back_no_engine_its_first_cell_does() -> None:
    async with LocalSessionProvider(max_engines=1, warm_engines=0) as provider:
        first = await provider.create_session(CodeModeSessionDelegate())
        await run(first, "text(1)")
        engine = first.engine
        second = await provider.create_session(CodeModeSessionDelegate())
        await asyncio.sleep(0.3)  # its engine would be taken meanwhile
        assert first.engine is engine and second.engine is None
        await run(second, "text(2)")
        assert first.engine is None and provider.pool.engines == 1


async def test_the_warm_engine_stays_within_the_bound() -> None:
    async with LocalSessionProvider(max_engines=1, warm_engines=1) as provider:
        await provider.warm()
        session = await provider.create_session(CodeModeSessionDelegate())
        await run(session, "text(1)")
        await asyncio.sleep(0.6)  # past the refill's delay
        assert provider.pool.engines == 1
        other = await provider.create_session(CodeModeSessionDelegate())
        assert (await run(other, "text(2)")).content_items == [InputText("2")]
        assert provider.pool.engines == 1


async def test_no_bound_when_asked() -> None:
    async with LocalSessionProvider(max_engines=None, warm_engines=0) as provider:
        sessions = [await provider.create_session(CodeModeSessionDelegate()) for _ in range(3)]
        await asyncio.gather(*(park(session) for session in sessions))
        assert provider.pool.engines == 3


async def test_a_closed_session_is_let_go() -> None:
    # Guards: the provider kept every session it ever made (with its store) until its own close.
    async with LocalSessionProvider(warm_engines=0) as provider:
        session: LocalSession | None = await provider.create_session(CodeModeSessionDelegate())
        assert session is not None
        await run(session, "store('k', 'x'.repeat(1000))")
        await session.shutdown()
        gone = weakref.ref(session)
        session = None
        gc.collect()
        assert gone() is None
        assert provider.pool.engines == 0


async def test_the_stdio_host_refuses_a_cell_past_max_engines() -> None:
    command = [sys.executable, "-m", "codemode", "host", "--stdio", "--max-engines", "1"]
    async with ProcessOwnedCodeModeSessionProvider(command) as provider:
        first = await provider.create_session(CodeModeSessionDelegate())
        second = await provider.create_session(CodeModeSessionDelegate())
        await park(first)
        with pytest.raises(CodeModeError) as refused:
            await run(second, "text(1)")
        assert refused.value.message == too_many_engines(1)
        await first.shutdown()
        assert (await run(second, "text(2)")).content_items == [InputText("2")]


async def test_the_grpc_host_refuses_a_cell_past_the_bound() -> None:
    from codemode.client.grpc import GrpcCodeModeSessionProvider
    from codemode.host.grpc import GrpcHost

    async with LocalSessionProvider(max_engines=1, warm_engines=0) as runtime:
        host = GrpcHost(runtime, "grpc://127.0.0.1:0")
        await host.start()
        try:
            async with GrpcCodeModeSessionProvider(host.url) as provider:
                first = await provider.create_session(CodeModeSessionDelegate())
                second = await provider.create_session(CodeModeSessionDelegate())
                await park(first)
                with pytest.raises(CodeModeError) as refused:
                    await run(second, "text(1)")
                # grpc.md §12: an admission limit of the host is RESOURCE_EXHAUSTED.
                assert refused.value.message == grpc_texts.operation_failed(
                    "execution", "RESOURCE_EXHAUSTED", too_many_engines(1)
                )
                await first.shutdown()
                assert (await run(second, "text(2)")).content_items == [InputText("2")]
        finally:
            await host.aclose()
