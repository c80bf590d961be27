"""``ToolRegistry(before_call=..., timeout=...)``: approve, deny or rewrite a nested call; bound it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from codemode.errors import CodeModeError
from codemode.model import CodeMode, Deny, NestedCall, Rewrite, ToolRegistry
from codemode.protocol.types import CellId, CodeModeNestedToolCall, CodeModeToolKind, ToolName
from codemode.session import CancellationToken
from tests.tools.cells import run_cell


async def test_before_call_denies_rewrites_or_lets_run() -> None:
    seen: list[tuple[str, object]] = []

    async def before_call(call: NestedCall) -> Deny | Rewrite | None:
        seen.append((call.tool.definition.name, call.arguments))
        assert call.context.runtime_tool_call_id.startswith("tool-")
        if call.tool.definition.name == "delete":
            return Deny("deleting needs a human: ask the user first")
        if call.arguments == {"city": "Paris"}:
            return Rewrite({"city": "Lyon"})
        return None

    registry = ToolRegistry(before_call=before_call)
    deleted: list[str] = []

    @registry.tool
    def delete(path: str) -> None:
        deleted.append(path)

    @registry.tool
    async def weather(city: str) -> str:
        return f"sunny in {city}"

    async with CodeMode(registry) as code_mode:
        run = await run_cell(
            code_mode,
            "try { await tools.delete({path: '/'}) } catch (e) { text(String(e)) }\n"
            "text(await tools.weather({city: 'Paris'}));\n"
            "text(await tools.weather({city: 'Oslo'}));",
        )
    assert run.success, run.texts
    assert run.texts == [
        "deleting needs a human: ask the user first",
        "sunny in Lyon",
        "sunny in Oslo",
    ]
    assert deleted == []
    assert seen == [
        ("delete", {"path": "/"}),
        ("weather", {"city": "Paris"}),
        ("weather", {"city": "Oslo"}),
    ]


async def test_a_rewrite_must_keep_the_argument_shape() -> None:
    registry = ToolRegistry(before_call=lambda call: Rewrite("not an object"))

    @registry.tool
    def echo(value: int) -> int:
        return value

    async with CodeMode(registry) as code_mode:
        run = await run_cell(
            code_mode, "try { await tools.echo({value: 1}) } catch (e) { text(String(e)) }"
        )
    # A broken hook is the delegate's failure (the text every carrier gives one).
    assert run.texts == [
        "code-mode delegate task failed: before_call rewrote `echo`: arguments must be an object"
    ]


@pytest.mark.timeout(30)
async def test_a_before_call_that_raises_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cell gets the delegate's failure text; the hook's traceback goes to the
    ``codemode.tools`` logger (nothing was logged: a broken approval policy went unseen)."""

    def before_call(call: NestedCall) -> None:
        raise RuntimeError("policy store unreachable")

    registry = ToolRegistry(before_call=before_call)

    @registry.tool
    def echo() -> None:
        raise AssertionError("never runs")

    with caplog.at_level("ERROR", logger="codemode.tools"):
        async with CodeMode(registry) as code_mode:
            run = await run_cell(
                code_mode, "try { await tools.echo() } catch (e) { text(String(e)) }"
            )
    assert run.texts == ["code-mode delegate task failed: policy store unreachable"]
    [record] = caplog.records
    assert record.getMessage() == "before_call failed for tool `echo`"
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)


async def test_a_timed_out_async_tool_is_cancelled() -> None:
    registry = ToolRegistry()
    cancelled = asyncio.Event()

    @registry.tool(timeout=0.2)
    async def slow() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    @registry.tool
    async def quick() -> str:
        return "quick"

    async with CodeMode(registry) as code_mode:
        began = time.monotonic()
        run = await run_cell(
            code_mode,
            "try { await tools.slow({}) } catch (e) { text(String(e)) }\n"
            "text(await tools.quick({}));",
        )
    assert run.texts == ["tool `slow` timed out after 0.2 s", "quick"]
    assert time.monotonic() - began < 10
    assert cancelled.is_set()


async def test_the_registry_timeout_bounds_every_tool_without_its_own() -> None:
    release = threading.Event()
    registry = ToolRegistry(timeout=0.2)

    @registry.tool
    def blocking() -> str:  # a sync tool: its thread cannot be interrupted, its result is dropped
        release.wait(10)
        return "late"

    @registry.tool(timeout=5)
    async def patient() -> str:
        await asyncio.sleep(0.4)
        return "patient"

    try:
        async with CodeMode(registry) as code_mode:
            run = await run_cell(
                code_mode,
                "try { await tools.blocking({}) } catch (e) { text(String(e)) }\n"
                "text(await tools.patient({}));",
            )
    finally:
        release.set()
    assert run.texts == ["tool `blocking` timed out after 0.2 s", "patient"]


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        ToolRegistry(timeout=0)
    registry = ToolRegistry()
    with pytest.raises(ValueError, match="positive number of seconds"):
        registry.tool(name="t", timeout=-1)(lambda: None)


async def test_sync_tools_run_in_a_worker_thread_unless_inline() -> None:
    registry = ToolRegistry()
    loop_thread = threading.get_ident()

    @registry.tool
    def threaded() -> bool:
        return threading.get_ident() == loop_thread

    @registry.tool(inline=True)
    def on_the_loop() -> bool:
        return threading.get_ident() == loop_thread

    async with CodeMode(registry) as code_mode:
        run = await run_cell(
            code_mode,
            "text(String(await tools.threaded({})) + ' ' + String(await tools.on_the_loop({})))",
        )
    assert run.texts == ["false true"]


async def test_a_cancelled_call_ends_its_tool_and_rejects_with_the_cancelled_text() -> None:
    """The token cancels the task the call runs in; the cell has gone, the registry's own
    answer is the cancelled text (and the task itself is not left cancelled)."""
    registry = ToolRegistry()
    started, cancelled = asyncio.Event(), asyncio.Event()

    @registry.tool
    async def hang() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with CodeMode(registry) as code_mode:
        rendered = asyncio.ensure_future(
            code_mode.handle_exec(
                "call-1", '// @exec: {"yield_time_ms": 100}\nawait tools.hang({})'
            )
        )
        await asyncio.wait_for(started.wait(), 10)
        await rendered
        await code_mode.handle_wait('{"cell_id": "1", "terminate": true}')
        await asyncio.wait_for(cancelled.wait(), 10)


@pytest.mark.timeout(30)
async def test_an_included_registry_serves_its_tools_with_its_own_hook_and_timeouts() -> None:
    """``include`` keeps each tool's timeout and hook (``codemode run --tools`` merges a tool
    file's registry into its own this way: the file's approval hook must still apply)."""
    inner = ToolRegistry(before_call=lambda call: Deny("inner says no"), timeout=0.2)
    inner.describe_namespace("files", "Files.")

    @inner.tool(namespace="files")
    def delete() -> None:
        raise AssertionError("denied calls never run")

    unguarded = ToolRegistry(timeout=0.2)

    @unguarded.tool
    async def hang() -> None:
        await asyncio.sleep(30)

    outer = ToolRegistry(before_call=lambda call: Deny("outer says no"))

    @outer.tool
    def own() -> None:
        raise AssertionError("denied calls never run")

    outer.include(inner)
    outer.include(unguarded)
    assert [definition.name for definition in outer.definitions()] == [
        "own",
        "files__delete",
        "hang",
    ]
    assert outer.namespace_descriptions()["files"].description == "Files."

    async def call(name: str, namespace: str | None = None) -> object:
        invocation = CodeModeNestedToolCall(
            CellId("1"), "tool-1", ToolName(name, namespace), CodeModeToolKind.FUNCTION, {}
        )
        return await outer.invoke_tool(invocation, CancellationToken())

    with pytest.raises(CodeModeError, match=r"^outer says no$"):
        await call("own")
    with pytest.raises(CodeModeError, match=r"^inner says no$"):
        await call("delete", "files")
    with pytest.raises(CodeModeError, match=r"^tool `hang` timed out after 0\.2 s$"):
        await call("hang")
    with pytest.raises(ValueError, match="already registered"):
        outer.include(inner)
