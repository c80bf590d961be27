"""The V1 host's callback settlement: a client's answer wakes the delegate's task in the loop
iteration that read it (``docs/decisions/0014-push-client.md``)."""

from __future__ import annotations

import asyncio

import pytest

from codemode.host.v1 import _Settlement
from codemode.protocol.delegation import CallbackFailed, ToolReturned


async def test_resolved_from_a_loop_callback_the_task_continues_at_once() -> None:
    loop = asyncio.get_running_loop()
    settlement = _Settlement(loop)
    seen: list[object] = []

    async def delegate() -> None:
        seen.append(await settlement)

    task = asyncio.ensure_future(delegate())
    await asyncio.sleep(0)  # the task now waits on the settlement
    order: list[str] = []

    def answer() -> None:  # as the data_received of a pushing transport would
        assert asyncio.current_task() is None
        settlement.set_result(ToolReturned(7))
        order.append(f"after set_result: {seen}")

    loop.call_soon(answer)
    await task
    assert order == ["after set_result: [ToolReturned(value=7)]"]


async def test_resolved_inside_a_task_the_awaiting_task_continues_later() -> None:
    settlement = _Settlement(asyncio.get_running_loop())
    seen: list[object] = []

    async def delegate() -> None:
        seen.append(await settlement)

    task = asyncio.ensure_future(delegate())
    await asyncio.sleep(0)
    settlement.set_result(CallbackFailed("no"))  # this test's own task is running
    assert seen == []
    await task
    assert seen == [CallbackFailed("no")]


async def test_a_settlement_already_resolved_is_not_awaited() -> None:
    settlement = _Settlement(asyncio.get_running_loop())
    settlement.set_result(ToolReturned(1))
    settlement.set_result(ToolReturned(2))  # the first result stays
    assert await settlement == ToolReturned(1)
    assert settlement.done() and not settlement.cancelled()


async def test_cancelling_the_awaiting_task_cancels_the_settlement() -> None:
    settlement = _Settlement(asyncio.get_running_loop())
    reached: list[str] = []

    async def delegate() -> None:
        try:
            await settlement
        except asyncio.CancelledError:
            reached.append("cancelled")
            raise

    task = asyncio.ensure_future(delegate())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reached == ["cancelled"]
    assert settlement.cancelled()
    settlement.set_result(ToolReturned(1))  # a late answer is ignored
    assert settlement.cancelled()
    with pytest.raises(asyncio.CancelledError):
        settlement.result()


async def test_callbacks_added_after_the_result_run_soon() -> None:
    loop = asyncio.get_running_loop()
    settlement = _Settlement(loop)
    settlement.set_result(ToolReturned(None))
    called: list[object] = []
    settlement.add_done_callback(called.append)
    assert called == []
    await asyncio.sleep(0)
    assert called == [settlement]
    assert settlement.remove_done_callback(called.append) == 0
