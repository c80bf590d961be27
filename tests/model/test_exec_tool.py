"""The exec and wait tool definitions (runtime.md §14 grammar, §15.1, §15.2, case J25)."""

from __future__ import annotations

from typing import Any

import pytest

from codemode.errors import CodeModeError
from codemode.model.exec_tool import (
    EXEC_GRAMMAR,
    NamespaceDescription,
    WaitArguments,
    build_exec_description,
    build_wait_description,
    exec_tool_spec,
    parse_wait_arguments,
    wait_tool_spec,
)
from codemode.protocol.types import CodeModeToolKind, ToolDefinition, ToolName

PRAGMA_EXAMPLE = '// @exec: {"yield_time_ms": 10000, "max_output_tokens": 1000}'
SET_TIMEOUT = "`setTimeout(callback: () => void, delayMs?: number)`"
CLEAR_TIMEOUT = "`clearTimeout(timeoutId?: number)`"
CALL_TOOL_RESULT = "type CallToolResult<TStructured = { [key: string]: unknown }>"
MCP_OUTPUT = {
    "type": "object",
    "properties": {
        "content": {"type": "array", "items": {"type": "object"}},
        "isError": {"type": "boolean"},
        "_meta": {"type": "object"},
    },
}


def function_tool(
    name: str,
    description: str = "",
    *,
    namespace: str | None = None,
    output_schema: Any = None,
) -> ToolDefinition:
    return ToolDefinition(
        name,
        ToolName(name, namespace),
        description,
        CodeModeToolKind.FUNCTION,
        None,
        output_schema,
    )


def test_grammar_is_the_spec_text() -> None:
    assert EXEC_GRAMMAR == (
        "start: pragma_source | plain_source\n"
        "pragma_source: PRAGMA_LINE NEWLINE SOURCE\n"
        "plain_source: SOURCE\n"
        "PRAGMA_LINE: /[ \\t]*\\/\\/ @exec:[^\\r\\n]*/\n"
        "NEWLINE: /\\r?\\n/\n"
        "SOURCE: /[\\s\\S]+/"
    )


def test_exec_tool_spec_is_a_responses_custom_tool() -> None:
    assert exec_tool_spec("desc") == {
        "type": "custom",
        "name": "exec",
        "description": "desc",
        "format": {"type": "grammar", "syntax": "lark", "definition": EXEC_GRAMMAR},
    }


def test_description_pinned_substrings_in_order() -> None:
    description = build_exec_description()
    markers = [
        "orchestrate",
        "fresh V8 isolate",
        "async module",
        "`await tools.exec_command(...)`",
        "`await tools.mcp__ologs__get_profile(...)`",
        "a string or an object",
        "no Node, no file system, no network access, no console",
        "not JSON, not a quoted string, not a markdown code fence",
        PRAGMA_EXAMPLE,
        "Defaults to 10000 ms.",
        "10000 tokens",
        "unawaited promises are silently discarded",
        "`exit()`",
        "`text(value:",
        "`JSON.stringify(...)`",
        "`image(imageUrlOrItem:",
        '_meta: { "codex/imageDetail": "original" }',
        "`audio(audioUrlOrItem:",
        "`AudioContent`",
        "`generatedImage(result: { image_url: string; output_hint?: string })`",
        "HTTP(S) URLs are not supported",
        "`store(key",
        "`load(key",
        "`notify(",
        "`custom_tool_call_output`",
        SET_TIMEOUT,
        CLEAR_TIMEOUT,
        "`ALL_TOOLS`",
        "`{ name, description }`",
        "`yield_control()`",
    ]
    positions = [description.find(marker) for marker in markers]
    missing = [marker for marker, at in zip(markers, positions, strict=True) if at < 0]
    assert not missing
    assert positions == sorted(positions)
    assert description.count(PRAGMA_EXAMPLE) == 1


def test_configured_default_yield_time_is_shown() -> None:
    assert "Defaults to 2500 ms." in build_exec_description(default_yield_time_ms=2500)
    assert "Defaults to 10000 ms." not in build_exec_description(default_yield_time_ms=2500)


def test_a_console_is_not_denied_where_cells_have_one() -> None:
    # With console=True the intro said "no console" and the helpers then documented console.log.
    with_console = build_exec_description(console=True)
    assert "no console" not in with_console
    assert "- This is raw JavaScript only: no Node, no file system, no network access.\n" in (
        with_console
    )
    assert "- `console.log(...values)`" in with_console
    without = build_exec_description()
    assert "no Node, no file system, no network access, no console.\n" in without
    assert "console.log" not in without


def test_store_load_omitted_when_disabled() -> None:
    description = build_exec_description(store_load=False)
    assert "store(" not in description
    assert "load(" not in description
    assert SET_TIMEOUT in description


def test_image_detail_omitted_when_unsupported() -> None:
    description = build_exec_description(image_detail=False)
    assert "`image(imageUrlOrItem:" in description
    assert "detail" not in description
    assert "codex/imageDetail" not in description


def test_deferred_note_only_with_deferred_tools() -> None:
    assert "ALL_TOOLS` by `name` and `description`" not in build_exec_description()
    description = build_exec_description(deferred_tools=[function_tool("later")])
    assert "may be omitted from this description" in description
    assert "filter `ALL_TOOLS` by `name` and `description`" in description


def test_tools_are_not_listed_unless_code_mode_only() -> None:
    tools = [function_tool("foo", "bar", output_schema=MCP_OUTPUT)]
    description = build_exec_description(tools)
    assert "### `foo`" not in description
    assert "Shared MCP Types:" not in description


def test_j25_code_mode_only_lists_each_tool() -> None:
    description = build_exec_description([function_tool("foo", "bar")], code_mode_only=True)
    assert "### `foo`\nbar" in description
    assert description.endswith(
        "### `foo`\nbar\n\nexec tool declaration:\n```ts\n"
        "declare const tools: { foo(args: unknown): Promise<unknown>; };\n```"
    )
    assert "Shared MCP Types:" not in description


def test_heading_shows_the_raw_name_when_normalization_changed_it() -> None:
    description = build_exec_description(
        [function_tool("hidden-dynamic-tool", "Hidden tool")], code_mode_only=True
    )
    assert "### `hidden_dynamic_tool` (`hidden-dynamic-tool`)\nHidden tool\n\n" in description


def test_shared_mcp_types_once_before_the_tools() -> None:
    tools = [
        function_tool("mcp__a__one", "One", output_schema=MCP_OUTPUT),
        function_tool("mcp__a__two", "Two", output_schema=MCP_OUTPUT),
    ]
    description = build_exec_description(tools, code_mode_only=True)
    assert description.count("Shared MCP Types:") == 1
    assert description.count(CALL_TOOL_RESULT) == 1
    assert "Shared MCP Types:\n```ts\ntype Role = " in description
    for name in (
        "Role",
        "MetaObject",
        "Annotations",
        "Icon",
        "TextResourceContents",
        "BlobResourceContents",
        "TextContent",
        "ImageContent",
        "AudioContent",
        "ResourceLink",
        "EmbeddedResource",
        "ContentBlock",
    ):
        assert f"type {name} = " in description
    assert description.index("Shared MCP Types:") < description.index("### `mcp__a__one`")
    assert "Promise<CallToolResult>;" in description


def test_shared_mcp_types_for_a_deferred_mcp_tool() -> None:
    description = build_exec_description(
        [function_tool("plain")],
        code_mode_only=True,
        deferred_tools=[function_tool("mcp__x__y", output_schema=MCP_OUTPUT)],
    )
    assert description.count(CALL_TOOL_RESULT) == 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("name", "heading"),
    [
        ("hidden-dynamic-tool", "### `hidden_dynamic_tool` (`hidden-dynamic-tool`)"),
        ("x\n## Fake section\ny", '### `x____Fake_section_y` (`"x\\n## Fake section\\ny"`)'),
        ("a\rb\u2028c\x85", '### `a_b_c_` (`"a\\rb\\u2028c\\u0085"`)'),
        ("a`b", "### `a_b` (``a`b``)"),
        ("``x", "### `__x` (``` ``x ```)"),
    ],
)
def test_a_raw_tool_name_stays_inside_its_heading(name: str, heading: str) -> None:
    # Guards the exec description's structure: a tool provider's raw name holding a line break
    # ended the heading and could start a section of its own (`## Fake section`), and one
    # holding a backtick closed its code span early.
    description = build_exec_description([function_tool(name, "Desc")], code_mode_only=True)
    assert f"\n\n{heading}\nDesc\n\nexec tool declaration:" in description
    assert "\n## Fake" not in description


def test_namespace_sections_once_per_group() -> None:
    tools = [
        function_tool("a1", "A1", namespace="alpha"),
        function_tool("a2", "A2", namespace="alpha"),
        function_tool("b1", "B1", namespace="beta"),
        function_tool("plain", "Plain"),
        function_tool("a3", "A3", namespace="alpha"),
        function_tool("g1", "G1", namespace="gamma"),
    ]
    namespaces = {
        "alpha": NamespaceDescription("Alpha server", "  Tools of alpha.\n"),
        "beta": NamespaceDescription("beta", "   "),
    }
    description = build_exec_description(
        tools, code_mode_only=True, namespace_descriptions=namespaces
    )
    assert description.count("## Alpha server\nTools of alpha.") == 2  # two separate groups
    assert "## beta" not in description  # blank description: no section
    assert "## gamma" not in description  # no registered description
    order = [
        "## Alpha server",
        "### `a1`",
        "### `a2`",
        "### `b1`",
        "### `plain`",
        "## Alpha server",
        "### `a3`",
        "### `g1`",
    ]
    cursor = 0
    for marker in order:
        cursor = description.index(marker, cursor) + 1
    assert "## Alpha server\nTools of alpha.\n\n### `a1`\nA1\n\n" in description


def test_wait_tool_spec() -> None:
    spec = wait_tool_spec()
    assert spec["type"] == "function"
    assert spec["name"] == "wait"
    assert spec["strict"] is False
    assert spec["parameters"] == {
        "type": "object",
        "properties": {
            "cell_id": {"type": "string", "description": "Identifier of the running exec cell."},
            "yield_time_ms": {
                "type": "number",
                "description": "Wait before yielding more output. Defaults to 10000 ms.",
            },
            "max_tokens": {
                "type": "number",
                "description": "Output token budget for this wait call. Defaults to 10000 tokens.",
            },
            "terminate": {
                "type": "boolean",
                "description": "True stops the running exec cell; false or omitted waits for output.",
            },
        },
        "required": ["cell_id"],
        "additionalProperties": False,
    }


def test_wait_description() -> None:
    description = build_wait_description()
    first, *bullets = description.split("\n")
    assert first == "Waits on a yielded `exec` cell and returns new output or completion."
    assert all(bullet.startswith("- ") for bullet in bullets)
    for marker in (
        "`Script running with cell ID ...`",
        "`cell_id`",
        "10000 ms",
        "`max_tokens`",
        "10000 tokens",
        "`terminate: true`",
        "since the last yield",
        "same `cell_id`",
        "closes it",
    ):
        assert marker in description


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"cell_id": "1"}', WaitArguments("1")),
        (
            '{"cell_id": "7", "yield_time_ms": 0, "max_tokens": 5, "terminate": true}',
            WaitArguments("7", 0, 5, True),
        ),
        ('{"cell_id": "1", "yield_time_ms": null, "extra": [1]}', WaitArguments("1")),
        ('{"cell_id": "1", "yield_time_ms": 18446744073709551615}', WaitArguments("1", 2**64 - 1)),
    ],
)
def test_parse_wait_arguments(arguments: str, expected: WaitArguments) -> None:
    assert parse_wait_arguments(arguments) == expected


def test_wait_argument_defaults() -> None:
    parsed = parse_wait_arguments('{"cell_id": "1"}')
    assert parsed.effective_yield_time_ms == 10_000
    assert parsed.effective_max_tokens == 10_000
    assert not parsed.terminate


@pytest.mark.parametrize(
    "arguments",
    [
        "",
        "not json",
        "[]",
        "{}",
        '{"cell_id": 1}',
        '{"cell_id": "1", "yield_time_ms": 1.5}',
        '{"cell_id": "1", "yield_time_ms": 10.0}',
        '{"cell_id": "1", "yield_time_ms": 1e3}',
        '{"cell_id": "1", "yield_time_ms": true}',
        '{"cell_id": "1", "max_tokens": -1}',
        '{"cell_id": "1", "max_tokens": "5"}',
        '{"cell_id": "1", "yield_time_ms": 18446744073709551616}',
        '{"cell_id": "1", "terminate": "yes"}',
    ],
)
def test_parse_wait_arguments_failures(arguments: str) -> None:
    with pytest.raises(CodeModeError) as caught:
        parse_wait_arguments(arguments)
    assert caught.value.message.startswith("failed to parse function arguments: ")
