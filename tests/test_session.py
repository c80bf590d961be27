"""The session API building blocks: StartedCell, CancellationToken, default delegate/provider."""

from __future__ import annotations

import asyncio
import contextvars
import gc
from typing import Any

import pytest

from codemode.errors import CodeModeError
from codemode.protocol import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    Result,
    ToolName,
)
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    NotificationAccepted,
    ToolReturned,
)
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    NoopCodeModeSessionDelegate,
    StartedCell,
    serve_callback,
)

CELL = CellId("1")


def test_cell_id_is_a_distinct_value_type() -> None:
    assert CellId("1") == CellId("1")
    assert hash(CellId("1")) == hash(CellId("1"))
    assert CellId("1") != "1"  # type: ignore[comparison-overlap]
    assert str(CellId("g2:42")) == "g2:42"
    assert str(CellId("")) == ""
    assert {CellId("a"): 1}[CellId("a")] == 1


async def test_initial_response_is_delivered_once() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Result] = loop.create_future()
    cell = StartedCell(CELL, future)  # type: ignore[arg-type]
    future.set_result(Result(CELL, [], None))
    assert await cell.initial_response() == Result(CELL, [], None)
    with pytest.raises(RuntimeError):
        await cell.initial_response()


async def test_producer_error_is_reraised_unchanged() -> None:
    async def producer() -> Result:
        raise CodeModeError("remote runtime failed")

    cell = StartedCell.from_awaitable(CELL, producer())
    with pytest.raises(CodeModeError) as caught:
        await cell.initial_response()
    assert str(caught.value) == "remote runtime failed"


async def test_vanished_producer_is_exec_runtime_ended_unexpectedly() -> None:
    future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
    cell = StartedCell(CELL, future)  # type: ignore[arg-type]
    future.cancel()
    with pytest.raises(CodeModeError, match=r"^exec runtime ended unexpectedly$"):
        await cell.initial_response()


async def test_cancelling_the_awaiting_task_abandons_the_cell() -> None:
    abandoned: list[bool] = []
    future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
    cell = StartedCell(CELL, future, lambda: abandoned.append(True))  # type: ignore[arg-type]
    task = asyncio.create_task(cell.initial_response())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert abandoned == [True]
    cell.cancel()  # idempotent
    assert abandoned == [True]


async def test_cancel_abandons_once_and_not_after_delivery() -> None:
    abandoned: list[int] = []
    loop = asyncio.get_running_loop()
    first: asyncio.Future[Result] = loop.create_future()
    cell = StartedCell(CELL, first, lambda: abandoned.append(1))  # type: ignore[arg-type]
    cell.cancel()
    cell.cancel()
    assert abandoned == [1]

    second: asyncio.Future[Result] = loop.create_future()
    delivered = StartedCell(CELL, second, lambda: abandoned.append(2))  # type: ignore[arg-type]
    second.set_result(Result(CELL))
    await delivered.initial_response()
    delivered.cancel()
    assert abandoned == [1]


async def test_dropping_an_unconsumed_cell_abandons_it() -> None:
    abandoned: list[bool] = []
    future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
    cell = StartedCell(CELL, future, lambda: abandoned.append(True))  # type: ignore[arg-type]
    del cell
    gc.collect()
    assert abandoned == [True]


async def test_cancellation_token() -> None:
    token = CancellationToken()
    seen: list[str] = []
    token.add_callback(lambda: seen.append("callback"))
    waiter = asyncio.create_task(token.wait_cancelled())
    await asyncio.sleep(0)
    assert not token.is_cancelled()
    token.cancel()
    token.cancel()
    await asyncio.wait_for(waiter, 1)
    assert token.is_cancelled()
    assert seen == ["callback"]
    token.add_callback(lambda: seen.append("late"))
    assert seen == ["callback", "late"]


async def test_noop_delegate_waits_for_cancellation_then_fails() -> None:
    delegate = NoopCodeModeSessionDelegate()
    token = CancellationToken()
    call = CodeModeNestedToolCall(CELL, "tool-1", ToolName.plain("t"), CodeModeToolKind.FUNCTION)
    task = asyncio.ensure_future(delegate.invoke_tool(call, token))
    await asyncio.sleep(0.01)
    assert not task.done()
    token.cancel()
    with pytest.raises(CodeModeError, match=r"^code mode nested tools are unavailable$"):
        await asyncio.wait_for(task, 1)
    await delegate.notify("call", CELL, "text", token)
    delegate.cell_closed(CELL)


class _Provider(CodeModeSessionProvider):
    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        raise CodeModeError("created")


async def test_provider_without_limit_support() -> None:
    provider = _Provider()
    provider.availability()
    delegate = CodeModeSessionDelegate()
    with pytest.raises(CodeModeError, match=r"^created$"):
        await provider.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())
    with pytest.raises(CodeModeError) as caught:
        await provider.create_session_with_limits(
            delegate, CodeModeSessionCellExecutionLimits(max_heap_size_bytes=1)
        )
    assert str(caught.value) == "code-mode session provider does not support resource limits"


# -- serve_callback: how every carrier runs a delegate callback ---------------------------------

ACTIVE: contextvars.ContextVar[str] = contextvars.ContextVar("active", default="outer")


async def test_a_callback_that_does_not_suspend_is_settled_at_once() -> None:
    settled: list[CallbackResult] = []

    async def tool() -> JSON:
        ACTIVE.set("inner")  # the callback's own context: nothing leaks to the caller
        return {"answer": 42}

    assert serve_callback(tool(), settled.append) is None
    assert settled == [ToolReturned({"answer": 42})]
    assert ACTIVE.get() == "outer"


async def test_the_first_step_runs_as_the_task_that_continues_it() -> None:
    settled: list[CallbackResult] = []
    seen: list[asyncio.Task[Any] | None] = []

    async def tool() -> JSON:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        seen.append(asyncio.current_task())
        return "done"

    caller = asyncio.current_task()
    task = serve_callback(tool(), settled.append)
    assert task is not None and not settled
    assert seen == [task]  # ran at once, as that task
    assert asyncio.current_task() is caller  # and the caller is current again
    await task
    assert seen == [task, task]
    assert settled == [ToolReturned("done")]


async def test_a_timeout_entered_in_the_first_step_belongs_to_the_callback() -> None:
    settled: list[CallbackResult] = []

    async def tool() -> JSON:
        try:
            async with asyncio.timeout(0.02):
                await asyncio.sleep(5)
        except TimeoutError:
            return "timed out"
        return "slept"

    task = serve_callback(tool(), settled.append)
    assert task is not None
    await asyncio.wait_for(task, 2)
    assert settled == [ToolReturned("timed out")]


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (CodeModeError("tool says no"), "tool says no"),
        (ValueError("bad"), "code-mode delegate task failed: bad"),
        (ValueError(), "code-mode delegate task failed: ValueError"),
    ],
)
async def test_a_failing_callback_settles_with_its_text(error: Exception, text: str) -> None:
    settled: list[CallbackResult] = []

    async def tool() -> JSON:
        await asyncio.sleep(0)
        raise error

    task = serve_callback(tool(), settled.append)
    assert task is not None
    await task
    assert settled == [CallbackFailed(text)]


async def test_a_cancelled_callback_task_settles_as_cancelled() -> None:
    settled: list[CallbackResult] = []

    async def notify() -> None:
        await asyncio.sleep(5)

    task = serve_callback(notify(), settled.append, notification=True)
    assert task is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert settled == [CallbackFailed("code-mode delegate task was cancelled")]
    done: list[CallbackResult] = []
    assert serve_callback(asyncio.sleep(0, None), done.append, notification=True) is not None
    await asyncio.sleep(0.01)
    assert done == [NotificationAccepted()]


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        ("result", ToolReturned({"answer": 42})),
        ("error", CallbackFailed("tool says no")),
        ("crash", CallbackFailed("code-mode delegate task failed: bad")),
        ("cancel", CallbackFailed("code-mode delegate task was cancelled")),
    ],
)
async def test_a_future_is_settled_from_its_done_callback_in_the_callbacks_context(
    outcome: str, expected: CallbackResult
) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[JSON] = loop.create_future()
    settled: list[tuple[CallbackResult, str]] = []
    context = contextvars.copy_context()
    context.run(ACTIVE.set, "the cell's")
    tasks = len(asyncio.all_tasks())
    running = serve_callback(
        future, lambda result: settled.append((result, ACTIVE.get())), context=context
    )
    assert running is future  # what the carrier cancels; no task of its own
    assert len(asyncio.all_tasks()) == tasks
    if outcome == "result":
        future.set_result({"answer": 42})
    elif outcome == "error":
        future.set_exception(CodeModeError("tool says no"))
    elif outcome == "crash":
        future.set_exception(ValueError("bad"))
    else:
        running.cancel()
    await asyncio.sleep(0)
    assert settled == [(expected, "the cell's")]
