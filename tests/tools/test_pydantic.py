"""Pydantic models and constraints in ``@tool`` signatures: schemas, validation, results."""

from __future__ import annotations

import threading
from typing import Annotated, Any

import msgspec
import pytest
from pydantic import BaseModel, ConfigDict, Field

from codemode.model import CodeMode, ToolRegistry, tool
from codemode.model.typescript import render_tool_declaration
from tests.tools.cells import run_cell


class Point(BaseModel):
    x: float
    y: float = Field(description="Vertical position")


class Polygon(BaseModel):
    corners: list[Point] = Field(min_length=3)


class Measure(BaseModel):
    area: float
    corners: int


@tool
def measure(
    polygon: Polygon, scale: Annotated[int, Field(ge=1, description="Scale factor")] = 1
) -> Measure:
    """Area of a polygon (shoelace formula)."""
    points = polygon.corners
    twice = sum(a.x * b.y - b.x * a.y for a, b in zip(points, points[1:] + points[:1], strict=True))
    return Measure(area=abs(twice) / 2 * scale * scale, corners=len(points))


@tool
def count(n: Annotated[int, Field(ge=0)]) -> list[int]:
    """Count up to n."""
    return list(range(n))


def test_constraints_and_models_are_in_the_schema() -> None:
    schema = measure.definition.input_schema
    assert isinstance(schema, dict)
    assert schema["required"] == ["polygon"]
    assert schema["properties"]["scale"] == {
        "type": "integer",
        "minimum": 1,
        "description": "Scale factor",
        "default": 1,
    }
    assert schema["properties"]["polygon"]["properties"]["corners"]["minItems"] == 3
    # the nested model's schema moved to the root `$defs`, where its `$ref` points
    assert schema["$defs"]["Point"]["required"] == ["x", "y"]
    assert count.definition.input_schema == {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0}},
        "required": ["n"],
        "additionalProperties": False,
    }
    declaration = render_tool_declaration(measure.definition)
    assert declaration.endswith("}): Promise<{ area: number; corners: number; }>;")
    assert "// Vertical position" in declaration
    assert "// Scale factor" in declaration


class Meta(msgspec.Struct):
    tag: str


class Holder(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    event: threading.Event


def test_plain_types_still_use_msgspec() -> None:
    @tool
    def plain(meta: Meta, n: Annotated[int, msgspec.Meta(ge=0)]) -> int:
        return n

    assert plain.definition.input_schema == {
        "type": "object",
        "properties": {"meta": {"$ref": "#/$defs/Meta"}, "n": {"type": "integer", "minimum": 0}},
        "required": ["meta", "n"],
        "additionalProperties": False,
        "$defs": {
            "Meta": {
                "title": "Meta",
                "type": "object",
                "properties": {"tag": {"type": "string"}},
                "required": ["tag"],
            }
        },
    }


def test_unsupported_types_fail_at_registration_naming_tool_and_parameter() -> None:
    def takes_holder(holder: Holder) -> None:
        pass

    with pytest.raises(TypeError, match=r"^tool `takes_holder`: parameter `holder`: "):
        tool(takes_holder)

    def constrained_lock(lock: Annotated[threading.Lock, Field(ge=0)]) -> None:
        pass

    with pytest.raises(TypeError, match=r"^tool `constrained_lock`: parameter `lock`: "):
        tool(constrained_lock)

    def returns_holder() -> Holder:
        raise NotImplementedError

    with pytest.raises(TypeError, match=r"^tool `returns_holder`: its return annotation "):
        tool(returns_holder)

    def plain_unsupported(a: int, callback: threading.Event) -> None:
        pass

    with pytest.raises(TypeError, match=r"^tool `plain_unsupported`: parameter `callback`: "):
        tool(plain_unsupported)

    class Local(BaseModel):
        x: int

    def local_hint(value: Local) -> None:  # the hint is a string naming a local class
        pass

    with pytest.raises(TypeError, match=r"^tool `local_hint`: cannot resolve its type hints"):
        tool(local_hint)


async def test_pydantic_tool_in_a_real_cell() -> None:
    received: list[Any] = []

    @tool
    async def save(point: Point) -> Point:
        """Store a point; returns it moved by one."""
        received.append(point)
        return Point(x=point.x + 1, y=point.y + 1)

    source = """
const square = [{x: 0, y: 0}, {x: 2, y: 0}, {x: 2, y: 2}, {x: 0, y: 2}];
text(JSON.stringify(await tools.measure({polygon: {corners: square}, scale: 2})));
text(JSON.stringify(await tools.save({point: {x: 1, y: 2}})));
for (const args of [{n: -1}, {n: "x"}, {}]) {
  try { await tools.count(args) } catch (e) { text(String(e)) }
}
try { await tools.measure({polygon: {corners: square.slice(0, 2)}}) } catch (e) { text(String(e)) }
try { await tools.measure({polygon: {corners: square}, scale: 0}) } catch (e) { text(String(e)) }
"""
    async with CodeMode(ToolRegistry([measure, count, save])) as code_mode:
        description = code_mode.exec_description()
        run = await run_cell(code_mode, source)
    assert "scale?: number;" in description
    assert run.success, run.texts
    assert run.texts == [
        '{"area":16,"corners":4}',
        '{"x":2,"y":3}',
        "invalid arguments for tool `count`: Input should be greater than or equal to 0 - at `$.n`",
        "invalid arguments for tool `count`: Input should be a valid integer, unable to parse "
        "string as an integer - at `$.n`",
        "invalid arguments for tool `count`: Object missing required field `n`",
        "invalid arguments for tool `measure`: List should have at least 3 items after "
        "validation, not 2 (at `corners`) - at `$.polygon`",
        "invalid arguments for tool `measure`: Input should be greater than or equal to 1 "
        "- at `$.scale`",
    ]
    assert received == [Point(x=1, y=2)]


class Shape(BaseModel):
    sides: int


def other_shape() -> type[BaseModel]:
    class Shape(BaseModel):  # same name, other fields
        name: str

    return Shape


def test_two_models_of_one_name_fail_at_registration() -> None:
    def both(a: list[Shape], b: list[Shape]) -> None:
        pass

    # nested (so referenced from `$defs`), two models of one name cannot both be declared
    other: Any = other_shape()
    both.__annotations__ = {"a": list[Shape], "b": list[other], "return": None}
    with pytest.raises(
        TypeError,
        match=r"^tool `both`: its parameters have no JSON Schema \(two different types are both named `Shape`\)$",
    ):
        tool(both)
