"""The embedded engine: crash recovery, isolation from Node, limits refused up front."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from codemode.errors import CodeModeError
from codemode.protocol import (
    CodeModeSessionCellExecutionLimits,
    CodeModeSessionDelegate,
    ExecuteRequest,
    InputText,
    Result,
)
from codemode.runtime import InvalidLimitsError, LocalSessionProvider


@pytest.fixture
async def provider() -> AsyncIterator[LocalSessionProvider]:
    async with LocalSessionProvider() as instance:
        yield instance


async def run(provider: LocalSessionProvider, source: str) -> Result:
    session = await provider.create_session(CodeModeSessionDelegate())
    started = await session.execute(ExecuteRequest(tool_call_id="c", source=source))
    response = await started.initial_response()
    assert isinstance(response, Result)
    return response


def engine_pid(provider: LocalSessionProvider) -> int:
    transport = provider.engine._transport
    assert transport is not None
    return transport.get_pid()


async def test_engine_crash_ends_running_cells_and_the_next_cell_gets_a_new_engine(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(CodeModeSessionDelegate())
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c", source='text("before"); while (true) {}', yield_time_ms=60_000
        )
    )
    await asyncio.sleep(0.2)
    os.kill(engine_pid(provider), signal.SIGKILL)
    response = await asyncio.wait_for(started.initial_response(), 5)
    assert response == Result(
        started.cell_id, [InputText("before")], "exec runtime ended unexpectedly"
    )
    again = await run(provider, 'text("alive")')
    assert again.content_items == [InputText("alive")]


@pytest.mark.parametrize(
    "probe",
    [
        "text.constructor.constructor('return typeof process')()",
        "tools.constructor === Object ? typeof Function('return this')().process : 'x'",
        "(() => { try { image('https://x/y.png') } catch (e) { return typeof e } })()",
        "(() => { try { load.call(null, { toString() { throw new Error('k') } }) } "
        "catch (e) { return e.constructor.constructor('return typeof process')() } })()",
        "Object.getOwnPropertyNames(globalThis).filter(n => /^(host|require|module|Buffer|process)$|^__/.test(n)).join() || 'undefined'",
    ],
)
async def test_cells_cannot_reach_node(provider: LocalSessionProvider, probe: str) -> None:
    result = await run(provider, f"text(String({probe}))")
    assert result.error_text is None, result.error_text
    assert result.content_items in ([InputText("undefined")], [InputText("string")])


async def test_zero_heap_limit_is_refused(provider: LocalSessionProvider) -> None:
    with pytest.raises(InvalidLimitsError) as caught:
        await provider.create_session_with_limits(
            CodeModeSessionDelegate(), CodeModeSessionCellExecutionLimits(max_heap_size_bytes=0)
        )
    assert str(caught.value) == (
        "invalid code-mode session execution limits: max_heap_size_bytes must be greater than 0"
    )
    assert isinstance(caught.value, CodeModeError)


async def test_many_cells_in_many_sessions_run_concurrently(provider: LocalSessionProvider) -> None:
    sessions = [await provider.create_session(CodeModeSessionDelegate()) for _ in range(4)]
    starts = [
        await session.execute(
            ExecuteRequest(
                tool_call_id="c",
                source=f'await new Promise(r => setTimeout(r, 100)); text("{index}:{cell}")',
            )
        )
        for index, session in enumerate(sessions)
        for cell in range(3)
    ]
    results = await asyncio.gather(*(started.initial_response() for started in starts))
    texts = sorted(item.text for result in results for item in result.content_items)  # type: ignore[union-attr]
    assert texts == sorted(f"{index}:{cell}" for index in range(4) for cell in range(3))


async def test_closed_provider_leaves_no_engine_process() -> None:
    provider = LocalSessionProvider()
    await run(provider, "text(1)")
    pid = engine_pid(provider)
    await provider.aclose()
    await asyncio.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
