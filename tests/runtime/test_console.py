"""The opt-in ``console`` of a cell (``LocalSessionProvider(console=True)``; off by default)."""

from __future__ import annotations

from codemode.model import CodeMode, ToolRegistry
from codemode.protocol import CellId, ExecuteRequest, InputText, Result
from codemode.runtime import LocalSessionProvider
from codemode.session import NoopCodeModeSessionDelegate

SOURCE = (
    'console.log("a", 1, {b: 2}, [3], null, undefined); console.info("i"); console.warn("w");'
    ' console.error("e"); console.debug(); text(typeof console)'
)


async def test_cells_have_no_console_by_default() -> None:
    async with LocalSessionProvider() as provider:
        session = await provider.create_session(NoopCodeModeSessionDelegate())
        started = await session.execute(ExecuteRequest("c", "text(typeof console)"))
        assert await started.initial_response() == Result(CellId("1"), [InputText("undefined")])


async def test_an_opted_in_console_appends_text() -> None:
    async with LocalSessionProvider(console=True) as provider:
        session = await provider.create_session(NoopCodeModeSessionDelegate())
        started = await session.execute(ExecuteRequest("c", SOURCE))
        response = await started.initial_response()
    assert response == Result(
        CellId("1"),
        [
            InputText('a 1 {"b":2} [3] null undefined'),
            InputText("i"),
            InputText("w"),
            InputText("e"),
            InputText(""),
            InputText("object"),
        ],
    )


async def test_the_exec_description_mentions_the_console_only_when_on() -> None:
    plain = CodeMode(ToolRegistry())
    with_console = CodeMode(ToolRegistry(), console=True)
    assert "console.log" not in plain.exec_description()
    assert "- `console.log(...values)` (also `info`, `warn`, `error`, `debug`)" in (
        with_console.exec_description()
    )
    async with with_console:
        rendered = await with_console.handle_exec("call-1", 'console.log("seen")')
    assert [item.text for item in rendered.items[1:] if isinstance(item, InputText)] == ["seen"]
    await plain.aclose()


async def test_the_console_is_of_the_cells_own_realm() -> None:
    """Nothing from outside the isolate: its functions' constructors reach no Node global."""
    source = (
        "const F = console.log.constructor;"
        " text(String(F === Function));"
        " text(F('return typeof process + typeof require + typeof globalThis.console')());"
        " text(Object.getPrototypeOf(console) === Object.prototype ? 'plain' : 'other')"
    )
    async with LocalSessionProvider(console=True) as provider:
        session = await provider.create_session(NoopCodeModeSessionDelegate())
        started = await session.execute(ExecuteRequest("c", source))
        response = await started.initial_response()
    assert response == Result(
        CellId("1"), [InputText("true"), InputText("undefinedundefinedobject"), InputText("plain")]
    )
