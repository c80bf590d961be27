"""JSON Schema → TypeScript (runtime.md §15.6, cases J01-J24) and identifier normalization (§4.1)."""

from __future__ import annotations

from typing import Any

import pytest

from codemode.model.typescript import (
    MAX_RENDERED_BYTES,
    mcp_structured_content_schema,
    normalize_identifier,
    render_json_schema,
    render_tool_declaration,
    render_tool_sample,
)
from codemode.protocol.types import CodeModeToolKind, ToolDefinition, ToolName

J02 = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
J05 = {"type": "object", "properties": {}, "additionalProperties": False}


def mcp_output(structured: Any = None) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "content": {"type": "array", "items": {"type": "object"}},
        "isError": {"type": "boolean"},
        "_meta": {"type": "object"},
    }
    if structured is not None:
        properties["structuredContent"] = structured
    return {"type": "object", "properties": properties, "required": ["content"]}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mcp__ologs__get_profile", "mcp__ologs__get_profile"),
        ("hidden-dynamic-tool", "hidden_dynamic_tool"),
        ("1tool", "_tool"),
        ("día", "d_a"),
        ("a.b c", "a_b_c"),
        ("", "_"),
        ("$x9", "$x9"),
        ("9", "_"),
        ("ü", "_"),
        ("a\U0001d518b", "a_b"),  # one astral character, one underscore
    ],
)
def test_normalize_identifier(name: str, expected: str) -> None:
    assert normalize_identifier(name) == expected


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # J01
        (True, "unknown"),
        (False, "never"),
        ({}, "unknown"),
        ("x", "unknown"),
        (None, "unknown"),
        ([{"type": "string"}], "unknown"),
        # J02-J07
        (J02, "{ city: string; }"),
        (
            {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "boolean"}}},
            "{ a?: boolean; b?: number; }",
        ),
        ({"type": "object"}, "{ [key: string]: unknown; }"),
        (J05, "{}"),
        ({"type": "object", "properties": {}}, "{ [key: string]: unknown; }"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "additionalProperties": {"type": "number"},
            },
            "{ a?: string; [key: string]: number; }",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "additionalProperties": True,
            },
            "{ a?: string; [key: string]: unknown; }",
        ),
        (
            {"type": "object", "properties": {"a-b": {"type": "string"}, "ok": {"type": "null"}}},
            '{ "a-b"?: string; ok?: null; }',
        ),
        ({"required": ["x"]}, "{ [key: string]: unknown; }"),
        ({"additionalProperties": False}, "{}"),
        # J08
        ({"enum": ["a", 1, None, True]}, '"a" | 1 | null | true'),
        ({"const": {"k": [1]}}, '{"k":[1]}'),
        ({"const": "é\n"}, '"é\\n"'),
        ({"enum": [], "type": "string"}, "string"),
        # J09
        ({"type": ["string", "null"]}, "string | null"),
        ({"type": "foo"}, "unknown"),
        (
            {"type": ["integer", 7, "array"], "items": {"type": "boolean"}},
            "number | Array<boolean>",
        ),
        # J10
        ({"type": "array", "items": {"type": "string"}}, "Array<string>"),
        (
            {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]},
            "[string, number]",
        ),
        ({"type": "array"}, "unknown[]"),
        ({"items": {"type": "string"}}, "Array<string>"),
        ({"prefixItems": []}, "unknown[]"),
        # J11
        ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "string | number"),
        ({"oneOf": [{"type": "string"}, {"const": 3}]}, "string | 3"),
        ({"anyOf": [], "oneOf": [{"type": "null"}]}, "null"),
        # J12
        (
            {
                "allOf": [
                    {"$ref": "#/$defs/Choice"},
                    {"type": "object", "properties": {"value": {"type": "string"}}},
                ],
                "$defs": {"Choice": {"oneOf": [{"type": "string"}, {"type": "number"}]}},
            },
            "(string | number) & { value?: string; }",
        ),
        # J13
        (
            {"$ref": "#/$defs/Label", "enum": ["A"], "$defs": {"Label": {"type": "string"}}},
            '(string) & ("A")',
        ),
        # J14
        ({"$ref": "#/$defs/Foo%20Bar", "$defs": {"Foo Bar": {"type": "string"}}}, "string"),
        # ref edge cases
        ({"$ref": "https://example.com/schema.json"}, "unknown"),
        ({"$ref": "#/$defs/Missing", "type": "string"}, "string"),
        ({"$ref": "#/$defs/Missing", "$defs": {"Missing2": {"type": "string"}}}, "unknown"),
        ({"$ref": "#/$defs/A~2", "$defs": {"A~2": {"type": "string"}}}, "unknown"),
        ({"$ref": "#/$defs/a~1b~0c", "$defs": {"a/b~c": {"type": "boolean"}}}, "boolean"),
        (
            {"$ref": "#/prefixItems/1", "prefixItems": [True, {"type": "null"}]},
            "(null) & ([unknown, null])",
        ),
        ({"$ref": "#/$defs/L", "$defs": {"L": {"type": "string"}}, "description": "d"}, "string"),
        ({"$ref": 5, "type": "number"}, "number"),
        ({"$ref": "#/$defs/U", "type": "string", "$defs": {"U": True}}, "string"),
        # `#` is the root: expanded twice on the path, the third occurrence is unknown.
        (
            {"$ref": "#", "type": "object", "properties": {"x": {"type": "string"}}},
            "(({ x?: string; }) & ({ x?: string; })) & ({ x?: string; })",
        ),
    ],
)
def test_render_json_schema(schema: Any, expected: str) -> None:
    assert render_json_schema(schema) == expected


def test_j15_refs_inside_a_sub_schema_with_its_own_id_are_unknown() -> None:
    schema = {
        "type": "object",
        "$defs": {"Choice": {"type": "string"}},
        "properties": {
            "nested": {
                "$id": "urn:nested",
                "$defs": {"Choice": {"type": "number"}},
                "type": "object",
                "properties": {"value": {"$ref": "#/$defs/Choice"}},
            }
        },
    }
    assert render_json_schema(schema) == "{ nested?: { value?: unknown; }; }"


def test_root_id_does_not_block_refs() -> None:
    schema = {"$id": "urn:root", "$ref": "#/$defs/A", "$defs": {"A": {"type": "string"}}}
    assert render_json_schema(schema) == "string"


def test_j16_property_descriptions_make_a_multiline_object() -> None:
    schema = {
        "type": "object",
        "properties": {
            "weather": {
                "type": "array",
                "description": "look up weather for a given list of locations",
                "items": {
                    "type": "object",
                    "properties": {"location": {"type": "string"}},
                    "required": ["location"],
                },
            }
        },
        "required": ["weather"],
    }
    assert render_json_schema(schema) == (
        "{\n  // look up weather for a given list of locations\n"
        "  weather: Array<{ location: string; }>;\n}"
    )


def test_multiline_description_lines_are_trimmed_and_blank_ones_skipped() -> None:
    schema = {
        "properties": {
            "b": {"type": "string", "description": "  first \r\n\n   second\t"},
            "a": {"type": "number"},
        },
        "additionalProperties": {"type": "boolean"},
    }
    assert render_json_schema(schema) == (
        "{\n  a?: number;\n  // first\n  // second\n  b?: string;\n  [key: string]: boolean;\n}"
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize("terminator", ["\r", "\u2028", "\u2029"])
def test_description_line_terminators_other_than_newline_end_the_comment(terminator: str) -> None:
    # Guards the `//` comments: JavaScript ends a line comment at CR, U+2028 and U+2029 too, so
    # a description split only on `\n` let its tail (`evil: number;`) out of the comment, into
    # the type the model reads as a property.
    schema = {
        "properties": {"a": {"type": "string", "description": f"first{terminator}evil: number;"}}
    }
    assert render_json_schema(schema) == "{\n  // first\n  // evil: number;\n  a?: string;\n}"


def test_j17_recursive_refs_expand_twice_per_path() -> None:
    schema = {
        "type": "object",
        "properties": {
            "clauses": {"type": "array", "items": {"$ref": "#/$defs/Boolean~1Clause~0v1"}}
        },
        "$defs": {
            "Boolean/Clause~v1": {
                "type": "object",
                "properties": {"query": {"$ref": "#/$defs/Query"}},
            },
            "Query": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "object",
                        "properties": {
                            "clauses": {
                                "type": "array",
                                "items": {"$ref": "#/$defs/Boolean~1Clause~0v1"},
                            }
                        },
                    },
                ]
            },
        },
    }
    rendered = render_json_schema(schema)
    assert "clauses?: Array<{ query?: string | { clauses?: Array<{" in rendered
    assert "query?: string | { clauses?: Array<unknown>; };" in rendered
    assert rendered == (
        "{ clauses?: Array<{ query?: string | { clauses?: Array<{ query?: string | "
        "{ clauses?: Array<unknown>; }; }>; }; }>; }"
    )


def test_j18_at_most_32_expansions_in_total() -> None:
    properties = {f"p{index:02}": {"$ref": "#/$defs/Item"} for index in range(34)}
    schema = {"type": "object", "properties": properties, "$defs": {"Item": {"type": "string"}}}
    rendered = render_json_schema(schema)
    assert rendered.count("string") == 32
    assert rendered.count("unknown") == 2
    assert "p31?: string;" in rendered
    assert "p32?: unknown;" in rendered


def test_j19_dangling_refs_do_not_consume_the_total() -> None:
    properties: dict[str, Any] = {
        f"p{index:02}": {"$ref": f"#/$defs/Missing{index}"} for index in range(32)
    }
    properties["z_valid"] = {"$ref": "#/$defs/Valid"}
    schema = {"type": "object", "properties": properties, "$defs": {"Valid": {"type": "string"}}}
    assert "z_valid?: string;" in render_json_schema(schema)


def test_j20_oversized_rendering_is_unknown() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "description": "x" * 16_000}},
    }
    assert render_json_schema(schema) == "unknown"


def test_rendering_just_under_the_size_cap_is_kept() -> None:
    description = "x" * (MAX_RENDERED_BYTES - 40)
    schema = {"type": "object", "properties": {"a": {"type": "string", "description": description}}}
    rendered = render_json_schema(schema)
    assert rendered.startswith("{\n  // xxx")
    assert len(rendered) <= MAX_RENDERED_BYTES


def test_j21_work_budget_from_repeated_large_expansions() -> None:
    item = {"type": "object", "properties": {"v": {"type": "string", "description": "x" * 8_000}}}
    properties = {f"p{index:02}": {"$ref": "#/$defs/Item"} for index in range(32)}
    schema = {"type": "object", "properties": properties, "$defs": {"Item": item}}
    assert render_json_schema(schema) == "unknown"


def test_j21_work_budget_refuses_a_huge_const_in_advance() -> None:
    schema = {"$ref": "#/$defs/Big", "$defs": {"Big": {"const": "x" * 64_000}}}
    assert render_json_schema(schema) == "unknown"


def test_small_const_behind_a_ref_is_rendered() -> None:
    schema = {"$ref": "#/$defs/Small", "$defs": {"Small": {"const": "x" * 100}}}
    assert render_json_schema(schema) == '"' + "x" * 100 + '"'


def nested_arrays(depth: int, leaf: Any) -> Any:
    schema = leaf
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_work_budget_counts_every_nested_sub_rendering() -> None:
    leaf = {"const": "x" * 600}
    shallow = render_json_schema(nested_arrays(40, leaf))
    assert shallow.startswith("Array<" * 40 + '"xxx')
    # ~1 300 bytes of output, far under the size cap, but each of the 100 levels re-charges it.
    assert len("Array<>" * 100) + 602 < MAX_RENDERED_BYTES
    assert render_json_schema(nested_arrays(100, leaf)) == "unknown"


def test_absurdly_deep_schema_is_unknown_not_a_crash() -> None:
    schema: Any = {"type": "string"}
    for _ in range(5_000):
        schema = {"anyOf": [schema]}
    assert render_json_schema(schema) == "unknown"


def definition(
    name: str,
    *,
    description: str = "",
    kind: CodeModeToolKind = CodeModeToolKind.FUNCTION,
    input_schema: Any = None,
    output_schema: Any = None,
) -> ToolDefinition:
    return ToolDefinition(
        name, ToolName.plain(name), description, kind, input_schema, output_schema
    )


def test_j22_tool_sample() -> None:
    tool = definition(
        "hidden-dynamic-tool",
        description="Hidden tool",
        input_schema=J02,
        output_schema={
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
    )
    assert render_tool_sample(tool) == (
        "Hidden tool\n\nexec tool declaration:\n```ts\ndeclare const tools: { "
        "hidden_dynamic_tool(args: { city: string; }): Promise<{ ok: boolean; }>; };\n```"
    )


def test_j23_mcp_output_renders_call_tool_result() -> None:
    structured = {
        "type": "object",
        "properties": {
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "string"}, "score": {"type": "number"}},
                    "required": ["id", "score"],
                },
            }
        },
        "required": ["results"],
    }
    tool = definition("mcp__sample__search", input_schema=J05, output_schema=mcp_output(structured))
    assert render_tool_declaration(tool) == (
        "mcp__sample__search(args: {}): Promise<CallToolResult<"
        "{ results: Array<{ id: string; score: number; }>; }>>;"
    )


def test_mcp_output_without_structured_content_is_plain_call_tool_result() -> None:
    tool = definition("mcp__s__t", output_schema=mcp_output())
    assert render_tool_declaration(tool) == "mcp__s__t(args: unknown): Promise<CallToolResult>;"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"content": {"type": "array"}}},
        {
            "properties": {
                "content": {"type": "array", "items": {"type": "object"}},
                "isError": {"type": "string"},
                "_meta": {"type": "object"},
            }
        },
        {
            "properties": {
                "content": {"type": "array", "items": {"type": "object"}},
                "isError": {"type": "boolean"},
            }
        },
        {"type": "object"},
        True,
    ],
)
def test_non_mcp_output_schemas(schema: Any) -> None:
    assert mcp_structured_content_schema(schema) is None


def test_j24_freeform_tool_declaration() -> None:
    tool = definition("patch", kind=CodeModeToolKind.FREEFORM, input_schema={"type": "object"})
    assert render_tool_declaration(tool) == "patch(input: string): Promise<unknown>;"
