"""JSON-Schema tools (``Tool.from_schema``) and OpenAI function-tool definitions in real cells."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from codemode.model import CodeMode, Tool, ToolContext, ToolRegistry
from codemode.model.typescript import render_tool_declaration
from codemode.protocol.types import CodeModeToolKind, ToolName
from codemode.tools import openai_tool
from tests.tools.cells import run_cell

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}

RESPONSES_SHAPE: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": False,
}

CHAT_SHAPE: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}


def weather(arguments: dict[str, Any]) -> dict[str, Any]:
    return {"city": arguments["city"], "unit": arguments.get("unit", "C"), "degrees": 21}


def test_from_schema_declares_the_schemas() -> None:
    item = Tool.from_schema(
        "lookup",
        "Look a key up.",
        {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        lambda arguments: arguments["key"],
        output_schema={"type": "string"},
        namespace="kv",
    )
    definition = item.definition
    assert definition.name == "kv__lookup"
    assert definition.tool_name == ToolName("lookup", "kv")
    assert definition.kind is CodeModeToolKind.FUNCTION
    assert render_tool_declaration(definition) == (
        "kv__lookup(args: { key: string; }): Promise<string>;"
    )


def test_from_schema_takes_the_boolean_schemas() -> None:
    # `true` (any value) is a valid JSON Schema: "input_schema must be a JSON Schema object".
    item = Tool.from_schema("anything", "Any input.", True, lambda arguments: arguments)
    assert item.definition.input_schema is True
    assert render_tool_declaration(item.definition) == "anything(args: unknown): Promise<unknown>;"
    never = Tool.from_schema("fails", "", {"type": "object"}, print, output_schema=False)
    assert render_tool_declaration(never.definition).endswith("): Promise<never>;")


def test_from_schema_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="reserved"):
        Tool.from_schema("exec", "", {"type": "object"}, print)
    with pytest.raises(TypeError, match="input_schema"):
        Tool.from_schema("x", "", "not a schema", print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        Tool.from_schema("x", "", {"type": "object"}, 42)  # type: ignore[arg-type]


@pytest.mark.parametrize("definition", [RESPONSES_SHAPE, CHAT_SHAPE], ids=["responses", "chat"])
def test_openai_shapes_declare_the_same_tool(definition: dict[str, Any]) -> None:
    item = openai_tool(definition, weather)
    assert item.definition.name == "get_weather"
    assert item.definition.description == "Current weather of a city."
    assert item.definition.input_schema == WEATHER_PARAMETERS
    assert item.definition.output_schema is None
    assert render_tool_declaration(item.definition) == (
        'get_weather(args: {\n  // City name\n  city: string;\n  unit?: "C" | "F";\n}): '
        "Promise<unknown>;"
    )


def test_openai_tool_without_parameters_takes_an_empty_object() -> None:
    item = openai_tool({"type": "function", "name": "ping"}, lambda arguments: "pong")
    assert item.definition.input_schema == {"type": "object", "properties": {}}
    assert item.definition.description == ""


@pytest.mark.parametrize(
    "definition",
    [
        {"type": "custom", "name": "x"},
        {"type": "function"},
        {"type": "function", "function": "x"},
        {"type": "function", "name": "x", "description": 3},
    ],
)
def test_openai_tool_rejects_what_is_not_a_function_tool(definition: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own text
        openai_tool(definition, weather)


async def test_schema_tools_in_a_real_cell() -> None:
    seen: list[ToolContext] = []

    async def remember(arguments: dict[str, Any], context: ToolContext) -> list[Any]:
        seen.append(context)
        await asyncio.sleep(0)
        return [arguments, str(context.cell_id)]

    def fail(arguments: dict[str, Any]) -> None:
        raise RuntimeError(f"no such city: {arguments['city']}")

    registry = ToolRegistry(
        [
            openai_tool(RESPONSES_SHAPE, weather),
            openai_tool(CHAT_SHAPE, fail, namespace="broken"),
            Tool.from_schema("remember", "Echo with the cell id.", {"type": "object"}, remember),
        ]
    )
    source = """
text(JSON.stringify(await tools.get_weather({city: "Oslo"})));
text(JSON.stringify(await tools.remember()));
try { await tools.broken__get_weather({city: "Atlantis"}) } catch (e) { text(String(e)) }
try { await tools.get_weather([1]) } catch (e) { text(String(e)) }
"""
    async with CodeMode(registry) as code_mode:
        assert "get_weather(args: {" in code_mode.exec_description()
        run = await run_cell(code_mode, source)
    assert run.success, run.texts
    assert run.texts == [
        '{"city":"Oslo","unit":"C","degrees":21}',
        f'[{{}},"{seen[0].cell_id}"]',
        "tool `broken__get_weather` failed: RuntimeError: no such city: Atlantis",
        "tool `get_weather` expects a JSON object for arguments",
    ]
