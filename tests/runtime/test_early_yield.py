"""Ending a started cell's initial observation early (``StartedCell.yield_early``, grpc.md §8.4)."""

from __future__ import annotations

import asyncio

import pytest

from codemode.errors import CodeModeError
from codemode.protocol import (
    CellId,
    CodeModeNestedToolCall,
    ExecuteRequest,
    InputText,
    Result,
    Terminated,
    ToolDefinition,
    ToolName,
    WaitRequest,
    Yielded,
)
from codemode.protocol.types import JSON, LiveCell
from codemode.runtime import LocalSessionProvider
from codemode.session import (
    EARLY_YIELD_UNSUPPORTED,
    CancellationToken,
    CodeModeSessionDelegate,
    NoopCodeModeSessionDelegate,
    StartedCell,
)

ECHO = ToolDefinition("echo", ToolName("echo"), "echo")
FOREVER = "await new Promise(() => {})"


class _HeldTool(CodeModeSessionDelegate):
    """A tool whose result the test releases: ``called`` is set when the cell calls it."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.release: asyncio.Future[JSON] = asyncio.get_running_loop().create_future()

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.called.set()
        return await self.release


def _texts(response: object) -> list[str]:
    items = getattr(response, "content_items", [])
    return [item.text for item in items if isinstance(item, InputText)]


async def test_yield_early_returns_the_items_so_far_and_the_cell_goes_on(
    provider: LocalSessionProvider,
) -> None:
    delegate = _HeldTool()
    session = await provider.create_session(delegate)
    source = 'text("a"); await tools.echo({}); text("b")'
    started = await session.execute(ExecuteRequest("c", source, [ECHO], yield_time_ms=60_000))
    initial = asyncio.ensure_future(started.initial_response())
    await asyncio.wait_for(delegate.called.wait(), 30)
    assert not initial.done()
    started.yield_early()
    response = await asyncio.wait_for(initial, 5)
    assert response == Yielded(started.cell_id, [InputText("a")])
    started.yield_early()  # delivered: a no-op
    delegate.release.set_result("ok")
    outcome = await session.wait(WaitRequest(started.cell_id, 30_000))
    assert outcome == LiveCell(Result(started.cell_id, [InputText("b")]))


async def test_yield_early_before_the_observation_attached_yields_as_soon_as_it_does(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(NoopCodeModeSessionDelegate())
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=60_000))
    started.yield_early()  # initial_response() is not awaited yet
    started.yield_early()  # idempotent
    response = await asyncio.wait_for(started.initial_response(), 5)
    assert isinstance(response, Yielded)
    # The cell still runs: a later observation yields on its own timer, terminate stops it.
    later = await session.wait(WaitRequest(started.cell_id, 50))
    assert isinstance(later, LiveCell) and isinstance(later.response, Yielded)
    stopped = await session.terminate(started.cell_id)
    assert isinstance(stopped, LiveCell) and isinstance(stopped.response, Terminated)


async def test_an_early_yield_loses_nothing_of_a_completing_cell(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(NoopCodeModeSessionDelegate())
    for index in range(5):
        started = await session.execute(
            ExecuteRequest("c", f'text("x{index}"); text("y{index}")', yield_time_ms=60_000)
        )
        if index % 2:
            await asyncio.sleep(0.01 * index)  # sometimes the completion comes first
        started.yield_early()
        response = await asyncio.wait_for(started.initial_response(), 30)
        seen = _texts(response)
        if isinstance(response, Yielded):
            final = await session.wait(WaitRequest(started.cell_id, 30_000))
            assert isinstance(final, LiveCell)
            response = final.response
            seen += _texts(response)
        assert isinstance(response, Result) and response.error_text is None
        assert seen == [f"x{index}", f"y{index}"]


async def test_yield_early_after_abandonment_is_a_no_op(provider: LocalSessionProvider) -> None:
    session = await provider.create_session(NoopCodeModeSessionDelegate())
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=60_000))
    started.cancel()
    started.yield_early()
    with pytest.raises(CodeModeError):
        await started.initial_response()


async def test_a_carrier_without_early_yield_raises_every_time() -> None:
    future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
    started = StartedCell(CellId("1"), future)  # type: ignore[arg-type]
    with pytest.raises(CodeModeError) as caught:
        started.yield_early()
    assert str(caught.value) == EARLY_YIELD_UNSUPPORTED
    future.set_result(Result(CellId("1")))
    await started.initial_response()
    with pytest.raises(CodeModeError):
        started.yield_early()


async def test_the_hook_is_passed_through_from_awaitable() -> None:
    calls: list[str] = []
    release: asyncio.Future[Result] = asyncio.get_running_loop().create_future()

    async def producer() -> Result:
        return await release

    started = StartedCell.from_awaitable(
        CellId("1"), producer(), yield_early=lambda: calls.append("yield")
    )
    started.yield_early()
    release.set_result(Result(CellId("1")))
    await started.initial_response()
    started.yield_early()  # delivered: the hook is not called again
    assert calls == ["yield"]


async def test_a_wait_ends_early_with_the_items_so_far(provider: LocalSessionProvider) -> None:
    session = await provider.create_session(NoopCodeModeSessionDelegate())
    source = "text('a'); await new Promise((r) => setTimeout(r, 100)); text('b'); " + FOREVER
    started = await session.execute(ExecuteRequest("c", source, [], 10))
    assert _texts(await started.initial_response()) == ["a"]
    signal = asyncio.Event()
    waiting = asyncio.ensure_future(
        session.wait(WaitRequest(started.cell_id, 60_000), early_yield=signal)
    )
    await asyncio.sleep(0.4)
    assert not waiting.done()
    signal.set()
    outcome = await asyncio.wait_for(waiting, 5)
    assert outcome == LiveCell(Yielded(started.cell_id, [InputText("b")]))
    # Already set: the wait yields at once, and the cell still runs.
    signal = asyncio.Event()
    signal.set()
    outcome = await asyncio.wait_for(
        session.wait(WaitRequest(started.cell_id, 60_000), early_yield=signal), 5
    )
    assert outcome == LiveCell(Yielded(started.cell_id, []))
    assert await session.terminate(started.cell_id) == LiveCell(Terminated(started.cell_id, []))
    await session.shutdown()


@pytest.mark.timeout(60)
async def test_a_v1_wait_refuses_an_early_yield_already_requested() -> None:
    from codemode.client import ProcessOwnedCodeModeSessionProvider

    async with ProcessOwnedCodeModeSessionProvider() as remote:
        session = await remote.create_session(NoopCodeModeSessionDelegate())
        started = await session.execute(ExecuteRequest("c", FOREVER, [], 10))
        await started.initial_response()
        raised = asyncio.Event()
        raised.set()
        with pytest.raises(CodeModeError) as caught:
            await session.wait(WaitRequest(started.cell_id, 10), early_yield=raised)
        assert str(caught.value) == EARLY_YIELD_UNSUPPORTED
        # Not set: the wait runs its course.
        outcome = await session.wait(WaitRequest(started.cell_id, 10), early_yield=asyncio.Event())
        assert outcome == LiveCell(Yielded(started.cell_id, []))
        await session.shutdown()
