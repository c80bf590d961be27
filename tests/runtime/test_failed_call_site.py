"""Where an uncaught tool failure was called: ``Result.failed_call`` (embedded runtime only).

The error text stays exactly the tool's failure text (R73); the site travels beside it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from codemode.protocol import CellId, ExecuteRequest, Result
from codemode.protocol.types import ToolCallSite, ToolDefinition
from codemode.runtime import LocalSessionProvider
from codemode.session import CodeModeSession
from tests.contract.delegate import FIXTURE_TOOLS, RecordingDelegate, function_tool


@pytest.fixture
async def session() -> AsyncIterator[CodeModeSession]:
    async with LocalSessionProvider() as provider:
        yield await provider.create_session(RecordingDelegate())


async def run(
    session: CodeModeSession, source: str, tools: list[ToolDefinition] | None = None
) -> Result:
    started = await session.execute(
        ExecuteRequest(
            "call-1", source, enabled_tools=list(FIXTURE_TOOLS if tools is None else tools)
        )
    )
    response = await started.initial_response()
    assert isinstance(response, Result)
    return response


async def test_an_uncaught_tool_failure_names_the_line_that_called_the_tool(
    session: CodeModeSession,
) -> None:
    result = await run(session, 'text("a");\nconst x = 1;\n  await tools.fail({});')
    assert result.error_text == "boom"  # R73: the text is the tool's, exactly
    assert result.failed_call == ToolCallSite("fail", 3, 15)


async def test_the_failed_call_among_several_is_the_one_named(session: CodeModeSession) -> None:
    source = "await tools.echo({});\nawait Promise.all([\n  tools.echo({}),\n  tools.fail({}),\n]);"
    result = await run(session, source)
    assert (result.error_text, result.failed_call) == ("boom", ToolCallSite("fail", 4, 9))


async def test_a_rethrown_failure_still_names_its_call(session: CodeModeSession) -> None:
    source = "let seen;\ntry { await tools.fail({}) } catch (e) { seen = e }\nthrow seen;"
    result = await run(session, source)
    assert result.failed_call == ToolCallSite("fail", 2, 19)


@pytest.mark.parametrize(
    "source",
    [
        "try { await tools.fail({}) } catch (e) {}\nthrow 'other';",
        "try { await tools.fail({}) } catch (e) {}\nthrow new Error('boom');",
        "throw 'boom';",  # the same text, but no tool failed
        "await tools.echo({});\nnull.x;",
    ],
)
async def test_an_error_that_is_not_a_tool_failure_names_no_call(
    session: CodeModeSession, source: str
) -> None:
    result = await run(session, source)
    assert result.error_text is not None
    assert result.failed_call is None


async def test_the_site_names_the_identifier_the_cell_wrote() -> None:
    class Failing(RecordingDelegate):
        async def invoke_tool(self, invocation, cancellation):  # type: ignore[no-untyped-def]
            raise RuntimeError("no")

    async with LocalSessionProvider() as provider:
        session = await provider.create_session(Failing())
        tool = function_tool("hidden-dynamic-tool")
        result = await run(session, "await tools.hidden_dynamic_tool({});", [tool])
    assert result.failed_call == ToolCallSite("hidden_dynamic_tool", 1, 13)


@pytest.mark.parametrize(
    "tamper",
    [
        "Error.stackTraceLimit = 0;",
        "Error.prepareStackTrace = () => { throw 'no'; };",
        "Error.prepareStackTrace = () => 42;",
        "Error.prepareStackTrace = () => 'at exec_main.mjs:999:1';",
        "globalThis.Error = function () { return {stack: 'exec_main.mjs:7:7'} };",
    ],
)
async def test_a_cell_that_tampers_with_stacks_only_changes_its_own_site(
    session: CodeModeSession, tamper: str
) -> None:
    result = await run(session, tamper + "\nawait tools.fail({});")
    assert result.error_text == "boom"
    # What the cell did to its own stacks may cost it the site, never the error or the host.
    assert result.failed_call in (None, ToolCallSite("fail", 2, 13), ToolCallSite("fail", 999, 1))
    follow = await run(session, "await tools.fail({});")
    assert follow.failed_call == ToolCallSite("fail", 1, 13)


async def test_a_cell_that_does_not_fail_has_no_site(session: CodeModeSession) -> None:
    result = await run(session, "try { await tools.fail({}) } catch (e) {}\ntext(1)")
    assert result.error_text is None
    assert result.failed_call is None
    assert result == Result(CellId("1"), result.content_items, None)
