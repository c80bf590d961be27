"""The V1 host's callback settlement: a future of the client's answer that settles the nested
call in the loop iteration that read the answer (``docs/decisions/0014-push-client.md``), with no
task per call (``serve_callback`` settles a future from its done callback)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from codemode.errors import CodeModeError
from codemode.host.v1 import _Settlement
from codemode.protocol.delegation import CallbackFailed, CallbackResult, ToolReturned
from codemode.session import serve_callback


async def test_served_as_a_delegate_callback_it_settles_at_once_without_a_task() -> None:
    loop = asyncio.get_running_loop()
    settlement = _Settlement(loop)
    settled: list[CallbackResult] = []
    running = serve_callback(settlement, settled.append)
    assert running is cast(object, settlement)  # what a cell cancels while the client answers
    order: list[str] = []

    def answer() -> None:  # as the data_received of a pushing transport would
        tasks_before = len(asyncio.all_tasks())
        settlement.set_result(ToolReturned(7))
        order.append(
            f"after set_result: {settled}, tasks {len(asyncio.all_tasks()) - tasks_before}"
        )

    loop.call_soon(answer)
    await asyncio.sleep(0)
    assert order == ["after set_result: [ToolReturned(value=7)], tasks 0"]


async def test_a_failed_callback_settles_with_the_client_text() -> None:
    settlement = _Settlement(asyncio.get_running_loop())
    settled: list[CallbackResult] = []
    serve_callback(settlement, settled.append)
    settlement.set_result(CallbackFailed("tool exploded"))  # inside this test's task: soon
    await asyncio.sleep(0)
    assert settled == [CallbackFailed("tool exploded")]


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
    assert order == ["after set_result: [7]"]


async def test_resolved_inside_a_task_the_awaiting_task_continues_later() -> None:
    settlement = _Settlement(asyncio.get_running_loop())
    seen: list[object] = []

    async def delegate() -> None:
        seen.append(await settlement)

    task = asyncio.ensure_future(delegate())
    await asyncio.sleep(0)
    settlement.set_result(ToolReturned("yes"))  # this test's own task is running
    assert seen == []
    await task
    assert seen == ["yes"]


async def test_a_settlement_already_resolved_is_not_awaited() -> None:
    settlement = _Settlement(asyncio.get_running_loop())
    settlement.set_result(ToolReturned(1))
    settlement.set_result(ToolReturned(2))  # the first result stays
    assert await settlement == 1
    assert settlement.done() and not settlement.cancelled()
    failed = _Settlement(asyncio.get_running_loop())
    failed.set_result(CallbackFailed("no"))
    with pytest.raises(CodeModeError, match=r"^no$"):
        await failed


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
