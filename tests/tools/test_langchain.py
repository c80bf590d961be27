"""LangChain tools through their OpenAI schema, run with ``ainvoke`` from a real cell."""

from __future__ import annotations

from typing import Annotated

import pytest
from langchain_core.tools import InjectedToolArg, StructuredTool, ToolException
from langchain_core.tools import tool as langchain_decorator

from codemode.model import CodeMode
from codemode.model.typescript import render_tool_declaration
from codemode.tools import langchain_tool
from tests.tools.cells import run_cell


@langchain_decorator
def multiply(a: int, b: Annotated[int, "the second factor"]) -> int:
    """Multiply two integers."""
    return a * b


async def lookup(key: str) -> dict[str, str]:
    if key == "missing":
        raise ToolException(f"no entry for {key}")
    return {"key": key, "value": key.upper()}


LOOKUP = StructuredTool.from_function(
    coroutine=lookup, name="lookup", description="Look a key up.", handle_tool_error=True
)


def test_declared_through_the_openai_schema() -> None:
    item = langchain_tool(multiply, namespace="lc")
    assert item.definition.name == "lc__multiply"
    assert item.definition.description == "Multiply two integers."
    assert render_tool_declaration(item.definition) == (
        "lc__multiply(args: {\n  a: number;\n  // the second factor\n  b: number;\n}): "
        "Promise<unknown>;"
    )


async def test_langchain_tools_in_a_real_cell() -> None:
    source = """
text(String(await tools.multiply({a: 6, b: 7})));
text(JSON.stringify(await tools.lookup({key: "abc"})));
text(JSON.stringify(await tools.lookup({key: "missing"})));
try { await tools.multiply({a: "six", b: 7}) } catch (e) { text(String(e).split("\\n")[0]) }
"""
    async with CodeMode([langchain_tool(multiply), langchain_tool(LOOKUP)]) as code_mode:
        run = await run_cell(code_mode, source)
    assert run.success, run.texts
    assert run.texts == [
        "42",
        '{"key":"abc","value":"ABC"}',
        '"no entry for missing"',  # handle_tool_error=True: LangChain returns the text
        "tool `multiply` failed: ValidationError: 1 validation error for multiply",
    ]


@langchain_decorator
def whoami(query: str, user_id: Annotated[str, InjectedToolArg] = "guest") -> str:
    """Look a record up for the user the application says."""
    return f"{user_id}: {query}"


@pytest.mark.timeout(60)
async def test_a_cell_cannot_set_an_argument_langchain_hides_from_the_model() -> None:
    # An InjectedToolArg is the application's to supply; the cell used to set it at will.
    item = langchain_tool(whoami)
    assert render_tool_declaration(item.definition) == (
        "whoami(args: { query: string; }): Promise<unknown>;"
    )
    source = (
        "text(await tools.whoami({query: 'a'}));\n"
        "text(await tools.whoami({query: 'b', user_id: 'admin'}));"
    )
    async with CodeMode([item]) as code_mode:
        run = await run_cell(code_mode, source)
    assert run.texts == ["guest: a", "guest: b"]
