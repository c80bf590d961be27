"""Sync tools on the registry's worker threads (``codemode.model.worker_pool``): batched hand-offs,
a blocked tool holds up nothing else, cancellation, failures, contextvars."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import threading
from collections.abc import AsyncIterator

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.errors import CodeModeError
from codemode.model import CodeMode, ToolContext, ToolRegistry
from codemode.model.worker_pool import WorkerPool
from codemode.protocol.types import CellId, CodeModeNestedToolCall, CodeModeToolKind, ToolName
from codemode.session import CancellationToken
from tests.tools.cells import run_cell

REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("REQUEST", default="none")


def call(name: str, payload: object = None, runtime_id: str = "tool-1") -> CodeModeNestedToolCall:
    return CodeModeNestedToolCall(
        CellId("1"), runtime_id, ToolName(name, None), CodeModeToolKind.FUNCTION, payload
    )


async def test_many_sync_calls_at_once_all_answer_correctly() -> None:
    registry = ToolRegistry()
    threads: set[int] = set()

    @registry.tool
    def square(i: int) -> dict[str, int]:
        threads.add(threading.get_ident())
        return {"i": i, "square": i * i}

    calls = [
        registry.invoke_tool(call("square", {"i": i}), CancellationToken()) for i in range(2000)
    ]
    results = await asyncio.wait_for(asyncio.gather(*calls), 30)
    assert results == [{"i": i, "square": i * i} for i in range(2000)]
    assert threading.get_ident() not in threads


async def test_many_sync_calls_from_a_cell_all_answer_correctly() -> None:
    registry = ToolRegistry()

    @registry.tool
    def double(i: int) -> int:
        return 2 * i

    async with CodeMode(registry) as code_mode:
        run = await run_cell(
            code_mode,
            "const all = await Promise.all(Array.from({length: 1000}, (_, i) => tools.double({i})));\n"
            "text(String(all.every((v, i) => v === 2 * i)) + ' ' + all.length)",
        )
    assert run.texts == ["true 1000"]


async def test_a_blocked_sync_tool_holds_up_neither_the_loop_nor_other_tools() -> None:
    registry = ToolRegistry()
    entered, release = threading.Event(), threading.Event()

    @registry.tool
    def blocked() -> str:
        entered.set()
        release.wait(30)
        return "released"

    @registry.tool
    def quick(i: int) -> int:
        return i

    @registry.tool
    async def coroutine() -> str:
        await asyncio.sleep(0)
        return "async"

    try:
        held = asyncio.ensure_future(registry.invoke_tool(call("blocked"), CancellationToken()))
        assert await asyncio.to_thread(entered.wait, 10)
        # The loop runs, an async tool answers, and sync tools queued behind the blocked one
        # get threads of their own.
        assert (
            await asyncio.wait_for(registry.invoke_tool(call("coroutine"), CancellationToken()), 10)
            == "async"
        )
        quick_calls = [
            registry.invoke_tool(call("quick", {"i": i}), CancellationToken()) for i in range(50)
        ]
        assert await asyncio.wait_for(asyncio.gather(*quick_calls), 10) == list(range(50))
        assert not held.done()
    finally:
        release.set()
    assert await asyncio.wait_for(held, 10) == "released"


async def test_a_cancelled_sync_call_rejects_at_once_and_its_result_is_dropped() -> None:
    registry = ToolRegistry()
    entered, release, finished = threading.Event(), threading.Event(), threading.Event()

    @registry.tool
    def slow(context: ToolContext) -> str:
        entered.set()
        release.wait(30)  # a thread cannot be interrupted: it runs to its end
        finished.set()
        return "late"

    token = CancellationToken()
    pending = asyncio.ensure_future(registry.invoke_tool(call("slow"), token))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        token.cancel()
        with pytest.raises(CodeModeError, match=r"^tool `slow` was cancelled$"):
            await asyncio.wait_for(pending, 10)
        assert not finished.is_set()
    finally:
        release.set()
    assert await asyncio.to_thread(finished.wait, 10)


async def test_a_sync_call_cancelled_from_another_thread_rejects() -> None:
    registry = ToolRegistry()
    entered, release = threading.Event(), threading.Event()

    @registry.tool
    def slow() -> str:
        entered.set()
        release.wait(30)
        return "late"

    token = CancellationToken()
    pending = asyncio.ensure_future(registry.invoke_tool(call("slow"), token))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        await asyncio.to_thread(token.cancel)
        with pytest.raises(CodeModeError, match=r"^tool `slow` was cancelled$"):
            await asyncio.wait_for(pending, 10)
    finally:
        release.set()


async def test_a_sync_call_past_its_timeout_rejects_while_its_thread_runs_on() -> None:
    registry = ToolRegistry(timeout=0.05)
    release, finished = threading.Event(), threading.Event()

    @registry.tool
    def stuck() -> str:
        release.wait(30)
        finished.set()
        return "late"

    try:
        with pytest.raises(CodeModeError, match=r"^tool `stuck` timed out after 0\.05 s$"):
            await asyncio.wait_for(registry.invoke_tool(call("stuck"), CancellationToken()), 10)
        assert not finished.is_set()
    finally:
        release.set()


async def test_a_call_cancelled_before_a_thread_took_it_never_runs() -> None:
    pool = WorkerPool(max_workers=1, stall=30)  # one thread, never a second
    entered, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def block() -> str:
        entered.set()
        release.wait(30)
        return "block"

    try:
        first = pool.submit(block, (), {})
        assert await asyncio.to_thread(entered.wait, 10)
        queued = pool.submit(ran.append, ("queued",), {})
        queued.cancel()
        last = pool.submit(ran.append, ("last",), {})
    finally:
        release.set()
    assert await asyncio.wait_for(first, 10) == "block"
    await asyncio.wait_for(last, 10)
    assert ran == ["last"]
    assert pool.workers == 1


async def test_a_failing_sync_tool_is_reported_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ToolRegistry()

    @registry.tool
    def broken(n: int) -> int:
        return helper_that_fails(n)

    caplog.set_level(logging.ERROR, logger="codemode.tools")
    with pytest.raises(CodeModeError) as caught:
        await registry.invoke_tool(call("broken", {"n": 3}), CancellationToken())
    assert caught.value.message == "tool `broken` failed: ValueError: bad n: 3"
    [record] = [r for r in caplog.records if r.name == "codemode.tools"]
    assert record.getMessage() == "tool `broken` failed"
    assert record.exc_info is not None
    assert "helper_that_fails" in caplog.text and "raise ValueError" in caplog.text


def helper_that_fails(n: int) -> int:
    raise ValueError(f"bad n: {n}")


async def test_stop_iteration_from_a_sync_tool_rejects_instead_of_hanging() -> None:
    registry = ToolRegistry()

    @registry.tool
    def exhausted() -> int:
        return next(iter([]))

    with pytest.raises(CodeModeError, match=r"^tool `exhausted` failed: RuntimeError: "):
        await asyncio.wait_for(registry.invoke_tool(call("exhausted"), CancellationToken()), 10)


async def test_sync_tools_see_the_callers_contextvars_in_a_copy() -> None:
    registry = ToolRegistry()

    @registry.tool
    def read_and_set() -> str:
        seen = REQUEST.get()
        REQUEST.set("set by the tool")  # in the tool's copy only
        return seen

    async def one(value: str) -> object:
        REQUEST.set(value)
        result = await registry.invoke_tool(call("read_and_set"), CancellationToken())
        assert REQUEST.get() == value
        return result

    results = await asyncio.gather(*(one(f"request {i}") for i in range(100)))
    assert results == [f"request {i}" for i in range(100)]


async def test_a_pool_serves_two_event_loops() -> None:
    pool = WorkerPool()

    def in_other_loop() -> list[int]:
        async def run() -> list[int]:
            return list(await asyncio.gather(*(pool.run(abs, -i) for i in range(200))))

        return asyncio.run(run())

    here = asyncio.gather(*(pool.run(abs, -i) for i in range(200)))
    there = await asyncio.to_thread(in_other_loop)
    assert await asyncio.wait_for(here, 10) == list(range(200))
    assert there == list(range(200))


async def test_a_loop_closed_before_its_stall_check_does_not_disarm_the_others() -> None:
    pool = WorkerPool(stall=0.05)
    release = threading.Event()

    def in_a_loop_that_closes_at_once() -> None:
        async def submit() -> None:
            pool.submit(release.wait, (30,), {})  # occupies the one running thread
            pool.submit(abs, (-1,), {})  # queued behind it: arms this loop's check
            # returning closes the loop before its check fires; the result is dropped

        asyncio.run(submit())

    try:
        await asyncio.to_thread(in_a_loop_that_closes_at_once)
        # This loop's own check still starts a thread for the calls waiting behind the blocked one.
        assert await asyncio.wait_for(pool.run(abs, -2), 10) == 2
    finally:
        release.set()


@pytest.mark.timeout(30)
async def test_queued_lanes_take_turns_for_the_threads() -> None:
    pool = WorkerPool(max_workers=1, stall=30)  # one thread, never a second
    entered, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def block() -> None:
        entered.set()
        release.wait(30)

    try:
        first = pool.submit(block, (), {}, "a")
        assert await asyncio.to_thread(entered.wait, 10)
        flood = [pool.submit(ran.append, (f"a{n}",), {}, "a") for n in range(100)]
        other = pool.submit(ran.append, ("b",), {}, "b")
        assert pool.queued == 101
    finally:
        release.set()
    await asyncio.wait_for(asyncio.gather(first, other, *flood), 10)
    # The other lane's call waits for one call of the flooding lane, not for the hundred.
    assert ran[:3] == ["a0", "b", "a1"]
    assert ran[3:] == [f"a{n}" for n in range(2, 100)]
    assert pool.queued == 0


@contextlib.asynccontextmanager
async def two_sessions(
    registry: ToolRegistry, carrier: str
) -> AsyncIterator[tuple[CodeMode, CodeMode]]:
    """Two ``CodeMode`` sessions served by ``registry``: embedded, or over one stdio host."""
    if carrier == "embedded":
        async with CodeMode(registry) as a, CodeMode(registry) as b:
            yield a, b
        return
    command = [sys.executable, "-m", "codemode", "host", "--stdio"]
    provider = ProcessOwnedCodeModeSessionProvider(command)
    async with (
        provider,
        CodeMode(registry, provider=provider) as a,
        CodeMode(registry, provider=provider) as b,
    ):
        yield a, b


@pytest.mark.timeout(90)
@pytest.mark.parametrize("carrier", ["embedded", "stdio"])
async def test_a_cell_flooding_a_slow_sync_tool_does_not_starve_another_sessions_call(
    carrier: str,
) -> None:
    # The worker threads are the process's: a cell's backlog of slow calls used to hold up
    # every other session's sync calls until it had run through (minutes, for a long backlog).
    # Over a remote carrier every call arrives with a CellId object of its own, so each call was
    # a lane of its own and the other call waited behind the whole backlog: a cell's calls now
    # share the lane named by their cell's context, on every carrier.
    done = 0
    seen_when_b_ran: list[int] = []
    registry = ToolRegistry()

    @registry.tool
    def slow() -> None:
        nonlocal done
        threading.Event().wait(0.05)
        done += 1

    @registry.tool
    def quick() -> None:
        seen_when_b_ran.append(done)

    flood = "await Promise.all(Array.from({length: 400}, () => tools.slow()));"
    async with two_sessions(registry, carrier) as (a, b):
        await a.start()
        await b.start()
        flooding = asyncio.create_task(
            a.handle_exec("a", '// @exec: {"yield_time_ms": 60000}\n' + flood)
        )
        while done == 0:
            await asyncio.sleep(0.01)
        rendered = await asyncio.wait_for(b.handle_exec("b", "await tools.quick();"), 30)
        assert rendered.success
        await asyncio.wait_for(flooding, 60)
    assert done == 400
    (seen,) = seen_when_b_ran
    assert seen < 200  # it ran among the first calls still to come, not after the 400
