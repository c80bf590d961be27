"""The Python tool registry and its delegate behaviour (runtime.md §4.4; cases R74-R77)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from typing import Annotated, Any

import msgspec
import pytest

from codemode.errors import CodeModeError
from codemode.model.exec_tool import build_exec_description
from codemode.model.registry import Tool, ToolContext, ToolRegistry, flat_tool_name, tool
from codemode.model.typescript import render_json_schema, render_tool_declaration
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ToolName,
)
from codemode.session import CancellationToken, CodeModeSessionDelegate

CELL = CellId("1")


class Point(msgspec.Struct):
    x: int
    y: int


class Summary(msgspec.Struct):
    total: int
    names: list[str]


class Span(msgspec.Struct):
    bounds: tuple[int, int]


def call(
    name: str,
    payload: JSON = None,
    *,
    namespace: str | None = None,
    kind: CodeModeToolKind = CodeModeToolKind.FUNCTION,
    runtime_id: str = "tool-1",
) -> CodeModeNestedToolCall:
    return CodeModeNestedToolCall(CELL, runtime_id, ToolName(name, namespace), kind, payload)


async def invoke(registry: ToolRegistry, invocation: CodeModeNestedToolCall) -> JSON:
    return await registry.invoke_tool(invocation, CancellationToken())


async def rejection(registry: ToolRegistry, invocation: CodeModeNestedToolCall) -> str:
    with pytest.raises(CodeModeError) as caught:
        await invoke(registry, invocation)
    return caught.value.message


def fixture_registry() -> ToolRegistry:
    """The §16 fixture tools a registry serves directly: echo, fail, patch, add, greet."""
    registry = ToolRegistry()

    @registry.tool(description="Echo tool")
    def echo(**arguments: Any) -> dict[str, Any]:
        return arguments

    @registry.tool
    async def fail() -> None:
        raise CodeModeError("boom")

    @registry.tool(freeform=True, description="Patch tool")
    def patch(source: str) -> str:
        return "patched:" + source

    @registry.tool
    def add(a: int, b: int = 1) -> int:
        """Add two integers."""
        return a + b

    @registry.tool(namespace="mcp__people")
    async def greet(name: str, point: Point | None = None) -> Summary:
        """Greet someone."""
        await asyncio.sleep(0)
        return Summary(total=1 if point is None else point.x + point.y, names=[name])

    return registry


# --- definitions -----------------------------------------------------------------------------


def test_registry_is_a_session_delegate() -> None:
    assert isinstance(ToolRegistry(), CodeModeSessionDelegate)


def test_definitions_in_registration_order() -> None:
    definitions = fixture_registry().definitions()
    assert [d.name for d in definitions] == ["echo", "fail", "patch", "add", "mcp__people__greet"]
    kinds = [d.kind for d in definitions]
    assert (
        kinds
        == [CodeModeToolKind.FUNCTION] * 2
        + [CodeModeToolKind.FREEFORM]
        + [CodeModeToolKind.FUNCTION] * 2
    )


def test_function_tool_definition_from_type_hints_and_docstring() -> None:
    definition = fixture_registry().definitions()[3]
    assert definition.tool_name == ToolName.plain("add")
    assert definition.description == "Add two integers."
    assert definition.input_schema == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "default": 1}},
        "required": ["a"],
        "additionalProperties": False,
    }
    assert definition.output_schema == {"type": "integer"}  # from `-> int`
    assert render_tool_declaration(definition) == (
        "add(args: { a: number; b?: number; }): Promise<number>;"
    )


def test_namespaced_tool_with_nested_struct() -> None:
    definition = fixture_registry().definitions()[4]
    assert definition.tool_name == ToolName("greet", "mcp__people")
    assert definition.name == "mcp__people__greet"
    assert render_json_schema(definition.input_schema) == (
        "{ name: string; point?: { x: number; y: number; } | null; }"
    )


def test_kwargs_become_additional_properties() -> None:
    definition = fixture_registry().definitions()[0]
    assert definition.input_schema == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": True,
    }

    @tool
    def scores(label: str, **scores: float) -> None:
        """Scores."""

    assert render_json_schema(scores.definition.input_schema) == (
        "{ label: string; [key: string]: number; }"
    )


def test_freeform_definition() -> None:
    definition = fixture_registry().definitions()[2]
    assert definition.kind is CodeModeToolKind.FREEFORM
    assert definition.input_schema is None
    assert definition.description == "Patch tool"
    assert render_tool_declaration(definition) == "patch(input: string): Promise<string>;"


def test_a_return_annotation_without_a_schema_is_refused_with_its_tool_name() -> None:
    with pytest.raises(TypeError, match=r"^tool `opaque`: its return annotation <class 'object'>"):

        @tool
        def opaque() -> object:
            return object()

    @tool
    def anything() -> Any:
        return 1

    @tool
    def nothing() -> None:
        return None

    assert anything.definition.output_schema is None
    assert nothing.definition.output_schema is None


def test_parameter_descriptions_and_output_schema() -> None:
    @tool(output_schema=Summary)
    def search(query: Annotated[str, msgspec.Meta(description="what to look for")]) -> Summary:
        """Search."""
        return Summary(0, [])

    assert render_tool_declaration(search.definition) == (
        "search(args: {\n  // what to look for\n  query: string;\n}): "
        "Promise<{ names: Array<string>; total: number; }>;"
    )
    raw = {"type": "object", "properties": {"ok": {"type": "boolean"}}}

    @tool(output_schema=raw, description="Explicit")
    def check() -> dict[str, bool]:
        return {"ok": True}

    assert check.definition.output_schema == raw
    assert check.definition.description == "Explicit"


def test_recursive_struct_schema_keeps_its_defs() -> None:
    schema = msgspec.json.schema(Tree)
    assert "$ref" in schema

    @tool
    def walk(tree: Tree) -> None:
        """Walk."""

    rendered = render_json_schema(walk.definition.input_schema)
    assert rendered.startswith("{ tree: { children: Array<{ children: Array<")


class Tree(msgspec.Struct):
    children: list[Tree]


def test_decorated_tool_is_still_callable() -> None:
    @tool
    def double(value: int) -> int:
        return value * 2

    assert isinstance(double, Tool)
    assert double(4) == 8
    assert repr(double) == "Tool('double')"


@pytest.mark.parametrize("name", ["exec", "wait"])
def test_exec_and_wait_are_reserved(name: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        tool(name=name)(lambda: None)


def test_duplicate_registration_is_refused() -> None:
    registry = fixture_registry()
    with pytest.raises(ValueError, match="already registered"):
        registry.tool(name="add")(lambda: None)


@pytest.mark.timeout(10)
def test_a_namespaced_name_that_spells_another_tools_name_is_refused() -> None:
    # Server `a`'s tool `b__c` used to shadow server `a__b`'s tool `c`: both are
    # `mcp__a__b__c`, and the cell's calls went to the one registered last.
    registry = ToolRegistry(
        [Tool.from_schema("c", "", {}, lambda arguments: "good", namespace="mcp__a__b")]
    )
    shadow = Tool.from_schema("b__c", "", {}, lambda arguments: "evil", namespace="mcp__a")
    with pytest.raises(ValueError, match=r"^tool `mcp__a__b__c` is already registered$"):
        registry.add(shadow)
    with pytest.raises(ValueError, match=r"^tool `mcp__a__b__c` is already registered$"):
        registry.add(Tool.from_schema("mcp__a__b__c", "", {}, lambda arguments: "plain"))
    assert [definition.name for definition in registry.definitions()] == ["mcp__a__b__c"]


@pytest.mark.parametrize(
    ("first", "second", "identifier"),
    [
        (("read", "mcp__a-b"), ("read", "mcp__a_b"), "mcp__a_b__read"),
        (("get-item", None), ("get_item", None), "get_item"),
        (("é", None), ("_", None), "_"),
    ],
    ids=["mcp-servers", "plain", "non-ascii"],
)
def test_names_that_are_one_identifier_in_a_cell_are_refused(
    first: tuple[str, str | None], second: tuple[str, str | None], identifier: str
) -> None:
    # `--mcp a-b=... --mcp a_b=...`: both servers' `read` were `tools.mcp__a_b__read`, and
    # the cell's calls went silently to the one registered last.
    one = Tool.from_schema(first[0], "", {}, lambda arguments: "one", namespace=first[1])
    registry = ToolRegistry([one])
    other = Tool.from_schema(second[0], "", {}, lambda arguments: "other", namespace=second[1])
    message = (
        f"tool `{other.definition.name}` would be `tools.{identifier}` in a cell, which tool "
        f"`{one.definition.name}` already is"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        registry.add(other)
    assert registry.definitions() == [one.definition]


async def test_a_dict_with_number_keys_takes_the_string_keys_a_cell_passes() -> None:
    # JavaScript object keys are strings: validation demanded int keys, so no call could pass.
    registry = ToolRegistry()

    @registry.tool
    def by_id(names: dict[int, str], **weights: dict[int, float]) -> str:
        return repr((names, weights))

    declaration = render_tool_declaration(by_id.definition)
    assert declaration.startswith("by_id(args: { names: { [key: string]: string; }; ")
    result = await invoke(registry, call("by_id", {"names": {"1": "a"}, "w": {"2": 0.5}}))
    assert result == "({1: 'a'}, {'w': {2: 0.5}})"
    message = await rejection(registry, call("by_id", {"names": {"one": "a"}}))
    assert message == (
        "invalid arguments for tool `by_id`: Expected `int`, got `str` - at `key` in `$.names`"
    )


def test_a_tuple_is_declared_as_a_typescript_tuple() -> None:
    # msgspec's schema has "items": false beside prefixItems, and §15.6 reads items first:
    # the model was told `Array<never>`, a type no value has.
    @tool
    def pair(p: tuple[int, str], spans: list[Span] | None = None) -> tuple[int, str]:
        """Takes and returns a fixed pair."""
        return p

    assert render_tool_declaration(pair.definition) == (
        "pair(args: { p: [number, string]; spans?: Array<{ bounds: [number, number]; }> | null; "
        "}): Promise<[number, string]>;"
    )
    assert pair.definition.input_schema["properties"]["p"] == {
        "type": "array",
        "minItems": 2,
        "maxItems": 2,
        "prefixItems": [{"type": "integer"}, {"type": "string"}],
    }


def test_unsupported_signatures() -> None:
    def star(*values: int) -> None: ...

    def two(a: str, b: str) -> None: ...

    def number(a: int) -> None: ...

    with pytest.raises(TypeError, match=r"\*args"):
        tool(star)
    with pytest.raises(TypeError, match="exactly one `str`"):
        tool(freeform=True)(two)
    with pytest.raises(TypeError, match="exactly one `str`"):
        tool(freeform=True)(number)


async def test_a_functools_partial_is_a_tool_whose_bound_keywords_are_fixed() -> None:
    # get_type_hints refused the partial: "functools.partial(...) is not a module, class,
    # method, or function", naming no tool.
    def scale(value: int, factor: int) -> int:
        """Scale a value."""
        return value * factor

    registry = ToolRegistry()
    triple = registry.tool(name="triple")(functools.partial(scale, factor=3))
    assert render_tool_declaration(triple.definition) == (
        "triple(args: { value: number; }): Promise<number>;"
    )
    assert triple.definition.description == "Scale a value."
    assert registry.tool(functools.partial(scale, 2)).definition.name == "scale"
    assert await invoke(registry, call("triple", {"value": 2})) == 6
    message = await rejection(registry, call("triple", {"value": 2, "factor": 5}))
    assert message == "invalid arguments for tool `triple`: Object contains unknown field `factor`"


def test_a_callable_without_hints_is_refused_with_a_message_naming_the_tool() -> None:
    class Adder:
        def __call__(self, a: int) -> int:
            return a

    with pytest.raises(TypeError, match=r"^tool `adder`: cannot read the type hints of .*Adder"):
        tool(name="adder")(Adder())
    with pytest.raises(TypeError, match=r"has no __name__: give the tool a name=$"):
        tool(Adder())


def test_a_lambda_needs_a_name_given() -> None:
    # Named `<lambda>` by Python: two of them were one tool, shown to the model as `_lambda_`.
    with pytest.raises(TypeError, match=r"has no name of its own: give the tool a name=$"):
        tool(lambda x: x)
    with pytest.raises(TypeError, match=r"has no name of its own: give the tool a name=$"):
        ToolRegistry().tool(functools.partial(lambda x, y: x, y=1))
    assert tool(name="echo")(lambda x: x).definition.name == "echo"


def test_a_default_that_is_not_json_is_refused_naming_the_parameter() -> None:
    # It was "its parameters have no JSON Schema (Encoding objects of type object is
    # unsupported)": which parameter, and why, was left to guess.
    missing = object()

    def lookup(key: str, fallback: int = missing) -> int:  # type: ignore[assignment]
        return 0

    with pytest.raises(TypeError) as caught:
        tool(lookup)
    assert str(caught.value) == (
        f"tool `lookup`: parameter `fallback`: its default {missing!r} is not JSON (Encoding "
        "objects of type object is unsupported); the model is shown a tool's defaults, so give "
        "a JSON value (None for none)"
    )


def test_flat_tool_name() -> None:
    assert flat_tool_name(ToolName.plain("x")) == "x"
    assert flat_tool_name(ToolName("get_profile", "mcp__ologs")) == "mcp__ologs__get_profile"


def test_namespace_descriptions_feed_the_exec_description() -> None:
    registry = fixture_registry()
    registry.describe_namespace("mcp__people", "People directory.", title="People")
    description = build_exec_description(
        registry.definitions(),
        code_mode_only=True,
        namespace_descriptions=registry.namespace_descriptions(),
    )
    assert "## People\nPeople directory.\n\n### `mcp__people__greet`\nGreet someone." in description


# --- §4.4 input rules ------------------------------------------------------------------------


async def test_exec_cannot_invoke_itself() -> None:
    assert await rejection(fixture_registry(), call("exec", {})) == "exec cannot invoke itself"


@pytest.mark.parametrize(
    ("invocation", "message"),
    [
        (call("nope", {}), "tool `nope` is not enabled in exec"),
        (call("wait", {}), "tool `wait` is not enabled in exec"),
        (call("greet", {"name": "x"}), "tool `greet` is not enabled in exec"),
        (call("add", {}, namespace="ns"), "tool `ns__add` is not enabled in exec"),
    ],
)
async def test_tool_not_enabled(invocation: CodeModeNestedToolCall, message: str) -> None:
    assert await rejection(fixture_registry(), invocation) == message


async def test_r74_function_tool_without_input_gets_an_empty_object() -> None:
    assert await invoke(fixture_registry(), call("echo")) == {}


async def test_function_tool_with_an_object() -> None:
    registry = fixture_registry()
    assert await invoke(registry, call("echo", {"d": "1970-01-01T00:00:00.000Z"})) == {
        "d": "1970-01-01T00:00:00.000Z"
    }
    assert await invoke(registry, call("add", {"a": 2, "b": 5})) == 7
    assert await invoke(registry, call("add", {"a": 2})) == 3


@pytest.mark.parametrize("payload", ["x", 1, 1.5, True, [1], ["a"]])
async def test_r75_function_tool_rejects_non_objects(payload: JSON) -> None:
    message = await rejection(fixture_registry(), call("echo", payload))
    assert message == "tool `echo` expects a JSON object for arguments"


async def test_r76_freeform_tool_gets_the_raw_string() -> None:
    invocation = call("patch", "*** Begin", kind=CodeModeToolKind.FREEFORM)
    assert await invoke(fixture_registry(), invocation) == "patched:*** Begin"


@pytest.mark.parametrize("payload", [{"a": 1}, None, 5, ["x"], True])
async def test_r77_freeform_tool_rejects_non_strings(payload: JSON) -> None:
    invocation = call("patch", payload, kind=CodeModeToolKind.FREEFORM)
    message = await rejection(fixture_registry(), invocation)
    assert message == "tool `patch` expects a string input"


async def test_the_definitions_kind_decides_not_the_calls() -> None:
    # A cell can only call with the kind it was given; the registry trusts its own definition.
    invocation = call("patch", "x", kind=CodeModeToolKind.FUNCTION)
    assert await invoke(fixture_registry(), invocation) == "patched:x"


async def test_namespaced_async_tool_returns_json_builtins() -> None:
    invocation = call("greet", {"name": "Ada", "point": {"x": 2, "y": 3}}, namespace="mcp__people")
    assert await invoke(fixture_registry(), invocation) == {"total": 5, "names": ["Ada"]}


# --- failures --------------------------------------------------------------------------------


async def test_code_mode_error_text_is_verbatim() -> None:
    assert await rejection(fixture_registry(), call("fail")) == "boom"


async def test_arbitrary_exceptions_are_described() -> None:
    registry = ToolRegistry()

    @registry.tool
    def broken(path: str) -> str:
        raise FileNotFoundError(f"no such file: {path}")

    message = await rejection(registry, call("broken", {"path": "/x"}))
    assert message == "tool `broken` failed: FileNotFoundError: no such file: /x"


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        ({"a": "2"}, "Expected `int`, got `str` - at `$.a`"),
        ({"b": 2}, "Object missing required field `a`"),
        ({"a": 1, "c": 3}, "Object contains unknown field `c`"),
        ({"a": 1.5}, "Expected `int`, got `float` - at `$.a`"),
    ],
)
async def test_bad_arguments_are_rejected_with_the_validation_error(
    payload: JSON, detail: str
) -> None:
    message = await rejection(fixture_registry(), call("add", payload))
    assert message == f"invalid arguments for tool `add`: {detail}"


@pytest.mark.timeout(10)
async def test_bad_kwargs_values_are_rejected_naming_the_key() -> None:
    # msgspec's path for a dict's value is `$[...]`: the cell was not told which key was wrong.
    registry = ToolRegistry()

    @registry.tool
    def scores(**values: float) -> dict[str, float]:
        return values

    @registry.tool
    def series(**values: list[int]) -> dict[str, list[int]]:
        return values

    assert await invoke(registry, call("scores", {"a": 1})) == {"a": 1.0}
    message = await rejection(registry, call("scores", {"a": 1, "b": "high"}))
    assert message == "invalid arguments for tool `scores`: Expected `float`, got `str` - at `$.b`"
    message = await rejection(registry, call("series", {"a": [1], "b": [2, "x"]}))
    assert message == "invalid arguments for tool `series`: Expected `int`, got `str` - at `$.b[1]`"


async def test_non_json_results_are_rejected() -> None:
    registry = ToolRegistry()

    @registry.tool
    def opaque() -> Any:
        return object()

    message = await rejection(registry, call("opaque"))
    assert message.startswith("tool `opaque` returned a value that is not JSON: ")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (float("nan"), "nan is not a JSON number"),
        ({"ratios": [1.0, float("-inf")]}, "-inf is not a JSON number"),
        ({(1, 2): "x"}, "Only dicts with str-like or number-like keys are supported"),
        (["report\udcff.txt"], "a string holds the lone surrogate U+DCFF"),
        (Summary(1, ["a\ud800"]), "a string holds the lone surrogate U+D800"),
    ],
    ids=["nan", "nested-inf", "tuple-key", "surrogate", "surrogate-in-struct"],
)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_every_non_json_result_names_the_tool(
    value: object, reason: str, is_async: bool
) -> None:
    # to_builtins let these through: the runtime's encoding then refused them as "code-mode
    # delegate returned a value that is not JSON", a text that names no tool.
    registry = ToolRegistry()

    def produce() -> Any:
        return value

    async def produce_async() -> Any:
        return value

    if is_async:
        registry.tool(name="produce")(produce_async)
    else:
        registry.tool(name="produce")(produce)
    message = await rejection(registry, call("produce"))
    assert message == f"tool `produce` returned a value that is not JSON: {reason}"


async def test_a_results_number_keys_become_the_strings_json_has() -> None:
    registry = ToolRegistry()

    @registry.tool
    def by_id() -> dict[int, str]:
        return {1: "a", 2: "b"}

    assert await invoke(registry, call("by_id")) == {"1": "a", "2": "b"}


async def test_mutable_defaults_are_fresh_per_call() -> None:
    registry = ToolRegistry()

    @registry.tool
    def collect(item: str, bag: list[str] = []) -> list[str]:  # noqa: B006 - on purpose
        bag.append(item)
        return bag

    assert await invoke(registry, call("collect", {"item": "a"})) == ["a"]
    assert await invoke(registry, call("collect", {"item": "b"})) == ["b"]


# --- context, sync tools, cancellation -------------------------------------------------------


async def test_tool_context_is_injected_and_not_part_of_the_schema() -> None:
    registry = ToolRegistry()
    seen: list[ToolContext] = []

    @registry.tool
    async def where(context: ToolContext, label: str) -> str:
        seen.append(context)
        return label

    assert registry.definitions()[0].input_schema["properties"] == {"label": {"type": "string"}}
    assert await invoke(registry, call("where", {"label": "x"}, runtime_id="tool-7")) == "x"
    (context,) = seen
    assert re.fullmatch(
        r"exec-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", context.call_id
    )
    assert context.cell_id == CELL
    assert context.runtime_tool_call_id == "tool-7"


async def test_sync_tools_run_in_a_worker_thread() -> None:
    registry = ToolRegistry()

    @registry.tool
    def thread_name() -> str:
        return threading.current_thread().name

    assert await invoke(registry, call("thread_name")) != threading.current_thread().name


async def test_cancellation_cancels_a_running_async_tool() -> None:
    registry = ToolRegistry()
    started = asyncio.Event()
    outcome: list[str] = []

    @registry.tool
    async def block() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return "released"

    token = CancellationToken()
    pending = asyncio.create_task(registry.invoke_tool(call("block", {}), token))
    await started.wait()
    token.cancel()
    with pytest.raises(CodeModeError, match=r"^tool `block` was cancelled$"):
        await asyncio.wait_for(pending, 1.0)
    assert outcome == ["cancelled"]


async def test_cancellation_abandons_a_running_sync_tool() -> None:
    registry = ToolRegistry()
    entered = threading.Event()
    release = threading.Event()

    @registry.tool
    def block() -> str:
        entered.set()
        release.wait(5)
        return "released"

    token = CancellationToken()
    pending = asyncio.create_task(registry.invoke_tool(call("block", {}), token))
    await asyncio.to_thread(entered.wait, 5)
    started = time.monotonic()
    token.cancel()
    try:
        with pytest.raises(CodeModeError, match="was cancelled"):
            await asyncio.wait_for(pending, 1.0)
        assert time.monotonic() - started < 1.0
    finally:
        release.set()


async def test_already_cancelled_token_never_runs_the_tool() -> None:
    registry = ToolRegistry()
    ran: list[bool] = []

    @registry.tool
    async def touch() -> None:
        ran.append(True)

    token = CancellationToken()
    token.cancel()
    with pytest.raises(CodeModeError, match="was cancelled"):
        await registry.invoke_tool(call("touch"), token)
    assert ran == []


async def test_cancelling_the_caller_propagates_and_stops_the_tool() -> None:
    registry = ToolRegistry()
    started = asyncio.Event()
    outcome: list[str] = []

    @registry.tool
    async def block() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    pending = asyncio.create_task(registry.invoke_tool(call("block"), CancellationToken()))
    await started.wait()
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert outcome == ["cancelled"]


async def test_cancellation_after_completion_is_harmless() -> None:
    registry = fixture_registry()
    token = CancellationToken()
    assert await registry.invoke_tool(call("add", {"a": 1}), token) == 2
    token.cancel()
    await asyncio.sleep(0)


# --- notify and cell_closed ------------------------------------------------------------------


async def test_notify_routes_to_a_sync_callback() -> None:
    received: list[tuple[str, CellId, str]] = []
    registry = ToolRegistry(on_notify=lambda *args: received.append(args))
    await registry.notify("call-1", CELL, "hello", CancellationToken())
    assert received == [("call-1", CELL, "hello")]


async def test_notify_routes_to_an_async_callback_and_honours_cancellation() -> None:
    received: list[str] = []
    started = asyncio.Event()

    async def slow(call_id: str, cell_id: CellId, text: str) -> None:
        received.append(text)
        started.set()
        await asyncio.Event().wait()

    registry = ToolRegistry(on_notify=slow)
    token = CancellationToken()
    pending = asyncio.create_task(registry.notify("call-1", CELL, "n", token))
    await started.wait()
    token.cancel()
    with pytest.raises(CodeModeError, match="notification was cancelled"):
        await asyncio.wait_for(pending, 1.0)
    assert received == ["n"]


async def test_notify_without_callback_returns() -> None:
    await ToolRegistry().notify("call-1", CELL, "n", CancellationToken())


def test_cell_closed_is_a_no_op_hook() -> None:
    registry = fixture_registry()
    registry.cell_closed(CELL)
    registry.cell_closed(CELL)
    assert registry.definitions()[0].name == "echo"


async def test_positional_only_parameters_and_context() -> None:
    registry = ToolRegistry()

    @registry.tool
    def tag(context: ToolContext, label: str, /, suffix: str = "!") -> str:
        return f"{context.runtime_tool_call_id}:{label}{suffix}"

    assert await invoke(registry, call("tag", {"label": "x"})) == "tool-1:x!"


async def test_tool_calls_are_logged_and_failures_keep_their_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ToolRegistry()

    @registry.tool
    def explode() -> int:
        raise ValueError("deep inside")

    @registry.tool
    def fine() -> int:
        return 1

    caplog.set_level(logging.DEBUG, logger="codemode.tools")
    assert await invoke(registry, call("fine")) == 1
    message = await rejection(registry, call("explode", runtime_id="tool-2"))
    assert message == "tool `explode` failed: ValueError: deep inside"
    records = [r for r in caplog.records if r.name == "codemode.tools"]
    calls = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert calls[0].startswith("event=tool-call tool=fine cell=1 call=tool-1 seconds=")
    assert calls[0].endswith(" outcome=ok")
    assert calls[1].endswith(" outcome=failed")
    (error,) = [r for r in records if r.levelno == logging.ERROR]
    assert error.getMessage() == "tool `explode` failed"
    assert error.exc_info is not None and "deep inside" in str(error.exc_info[1])
