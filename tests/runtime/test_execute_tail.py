"""The engine's work between cells (decision 0013): the spare isolate, the prelude's code cache,
the completed cell's isolate disposed a turn later. None of it may weaken what a cell gets: a
fresh isolate each, a working prelude, stoppable runaways, heap limits."""

from __future__ import annotations

import asyncio

import pytest

from codemode.protocol import (
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    Result,
    Terminated,
    Yielded,
)
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.session import CodeModeSessionDelegate


async def run(session: LocalSession, source: str) -> Result:
    started = await session.execute(ExecuteRequest(tool_call_id="c", source=source))
    response = await started.initial_response()
    assert isinstance(response, Result)
    return response


async def test_cells_back_to_back_each_get_a_fresh_isolate_with_a_working_prelude(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(CodeModeSessionDelegate())
    for i in range(40):
        # Every prelude function a cell uses comes from the code cache after the first cell.
        result = await run(
            session,
            f"if (typeof leaked !== 'undefined' || [].polluted) throw new Error('state of an"
            f" earlier cell');\nglobalThis.leaked = {i}; Array.prototype.polluted = true;\n"
            f"store('k', {i}); text(String(load('k')));",
        )
        assert result.error_text is None, (i, result.error_text)
        assert result.content_items == [InputText(str(i))]
    failed = await run(session, "function unused() { return 1 }\nnull.x;")
    assert failed.error_text is not None
    assert failed.error_text.startswith("TypeError: Cannot read properties of null")
    assert "exec_main.mjs:2:" in failed.error_text


async def test_cells_with_other_heap_limits_do_not_take_each_others_spare(
    provider: LocalSessionProvider,
) -> None:
    small = await provider.create_session_with_limits(
        CodeModeSessionDelegate(), CodeModeSessionCellExecutionLimits(max_heap_size_bytes=16 << 20)
    )
    large = await provider.create_session(CodeModeSessionDelegate())
    for _ in range(3):
        bomb = await run(small, "const a = []; for (;;) a.push(new Array(1000).fill(1));")
        assert bomb.error_text == f"exec cell exceeded the heap limit of {16 << 20} bytes"
        fine = await run(large, "const a = new Array(4e6).fill(1); text(String(a.length));")
        assert fine.content_items == [InputText("4000000")]


async def test_a_cell_that_runs_on_while_others_end_is_still_stoppable(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(CodeModeSessionDelegate())
    spinning = await session.execute(ExecuteRequest(tool_call_id="s", source="for (;;) {}"))
    for i in range(5):  # cells that end while the spinning one runs (the spare is made anew)
        assert (await run(session, f"text('{i}')")).content_items == [InputText(str(i))]
    await asyncio.sleep(0.05)  # past the spare timer of the spinning cell
    outcome = await asyncio.wait_for(session.terminate(spinning.cell_id), 10)
    assert isinstance(outcome.response, Terminated)
    assert (await run(session, "text('after')")).content_items == [InputText("after")]


async def test_microtasks_a_cell_leaves_run_before_its_result(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session_with_limits(
        CodeModeSessionDelegate(), CodeModeSessionCellExecutionLimits(max_heap_size_bytes=16 << 20)
    )
    # As on the upstream host, what the cell's body left queued as microtasks runs before its
    # result, and what it emits is part of it.
    drained = await asyncio.wait_for(
        run(
            session,
            "text('done'); (async () => { for (let i = 0; i < 1000; i++) await null;"
            " text('drained') })();",
        ),
        10,
    )
    assert drained.content_items == [InputText("done"), InputText("drained")]
    # Their stores are committed too, even those made after the end's writes were taken.
    chain = "Promise.resolve()" + ".then(() => 0)" * 8
    stored = await asyncio.wait_for(
        run(session, chain + ".then(() => store('k', 'late')); text('a')"), 10
    )
    assert stored.content_items == [InputText("a")]
    loaded = await asyncio.wait_for(run(session, "text(String(load('k')))"), 10)
    assert loaded.content_items == [InputText("late")]
    # Leftovers that allocate for ever end at the heap limit.
    allocating = await asyncio.wait_for(
        run(
            session,
            "text('done'); (async () => { for (let i = 0; i < 4; i++) await null;"
            " const a = []; for (;;) a.push(new Array(1000).fill(1)); })();",
        ),
        10,
    )
    assert allocating.error_text is not None
    # Leftovers that spin keep the cell from completing (upstream too): it yields, a terminate
    # ends it, and the session's next cell runs.
    await spin_then_terminate(session)
    again = await asyncio.wait_for(run(session, "text('next')"), 10)
    assert again.content_items == [InputText("next")]


async def spin_then_terminate(session: LocalSession) -> None:
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="left",
            source="text('done'); (async () => { for (let i = 0; i < 4; i++) await null;"
            " for (;;) {} })();",
            yield_time_ms=200,
        )
    )
    first = await asyncio.wait_for(started.initial_response(), 10)
    assert isinstance(first, Yielded)
    assert first.content_items == [InputText("done")]
    outcome = await asyncio.wait_for(session.terminate(started.cell_id), 10)
    assert isinstance(outcome.response, Terminated)


@pytest.mark.timeout(60)
async def test_cells_that_come_apart_or_during_the_wait_after_an_end_each_get_a_fresh_isolate(
    provider: LocalSessionProvider,
) -> None:
    # After a cell that came a while after the previous one ended, the engine makes the next
    # spare (and disposes the completed isolate) a little later; an exec that comes during that
    # wait takes an isolate made for it and cancels the wait.
    session = await provider.create_session(CodeModeSessionDelegate())
    source = (
        "if (typeof leaked !== 'undefined' || [].polluted) throw new Error('state of an earlier"
        " cell');\nglobalThis.leaked = 1; Array.prototype.polluted = true; text(String({i}));"
    )
    for i in range(12):
        if i % 3 == 0:
            await asyncio.sleep(0.02)  # apart: the next end waits before making the spare
        elif i % 3 == 2:
            await asyncio.sleep(0.001)  # likely inside that wait
        result = await asyncio.wait_for(run(session, source.replace("{i}", str(i))), 10)
        assert result.error_text is None, (i, result.error_text)
        assert result.content_items == [InputText(str(i))]
    # A cell whose leftover microtasks spin is ended by a terminate after a paced end too.
    await asyncio.sleep(0.02)
    await spin_then_terminate(session)
    await asyncio.sleep(0.02)
    again = await asyncio.wait_for(run(session, "text('next')"), 10)
    assert again.content_items == [InputText("next")]
    spinning = await session.execute(ExecuteRequest(tool_call_id="s", source="for (;;) {}"))
    await asyncio.sleep(0.05)
    outcome = await asyncio.wait_for(session.terminate(spinning.cell_id), 10)
    assert isinstance(outcome.response, Terminated)
