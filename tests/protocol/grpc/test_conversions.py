"""Domain ⇄ gRPC conversions (``grpc.md`` §10, §6.3): round trips through the encoded bytes, and
every error with its exact text."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import pytest
from google.protobuf.message import Message
from hypothesis import given

from codemode.errors import RemoteProtocolError, WireConversionError
from codemode.protocol.delegation import CallbackFailed, ToolReturned
from codemode.protocol.grpc import conversions as c
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import MAX_MESSAGE_BYTES
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ContentItem,
    ExecuteRequest,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    RuntimeResponse,
    Terminated,
    ToolDefinition,
    ToolName,
    WaitOutcome,
    WaitRequest,
    Yielded,
)
from tests.protocol.grpc import strategies as s

U64_MAX = 2**64 - 1
I32_MAX = 2**31 - 1
OUT_OF_RANGE = "out of range integral type conversion attempted"
M = TypeVar("M", bound=Message)


def wire(message: M) -> M:
    """``message`` after a trip through its encoding, as the peer sees it."""
    return type(message).FromString(message.SerializeToString())


def outcome(**fields: Any) -> pb.ExecutionOutcome:
    proto = pb.ExecutionOutcome(**fields)
    if proto.WhichOneof("outcome") is None:
        proto.yielded.SetInParent()
    return proto


# -- content items ------------------------------------------------------------------------------------


@given(s.content_items)
def test_content_items_round_trip(item: ContentItem) -> None:
    assert c.content_item_to_domain(wire(c.content_item_to_proto(item))) == item


@pytest.mark.parametrize(
    ("detail", "value"),
    [
        (ImageDetail.AUTO, pb.IMAGE_DETAIL_AUTO),
        (ImageDetail.LOW, pb.IMAGE_DETAIL_LOW),
        (ImageDetail.HIGH, pb.IMAGE_DETAIL_HIGH),
        (ImageDetail.ORIGINAL, pb.IMAGE_DETAIL_ORIGINAL),
    ],
)
def test_each_image_detail_has_its_enum_value(detail: ImageDetail, value: int) -> None:
    proto = c.content_item_to_proto(InputImage("data:x", detail))
    assert proto.image.HasField("detail")
    assert proto.image.detail == value
    assert c.content_item_to_domain(proto) == InputImage("data:x", detail)


def test_an_absent_image_detail_is_none_both_ways() -> None:
    proto = c.content_item_to_proto(InputImage("data:x"))
    assert not proto.image.HasField("detail")
    assert c.content_item_to_domain(proto) == InputImage("data:x", None)


@pytest.mark.parametrize("value", [0, 5, 99, -1])
def test_an_unspecified_or_unknown_image_detail_is_refused(value: int) -> None:
    proto = wire(
        pb.ContentItem(
            image=pb.ImageContent(image_url="data:x", detail=pb.ImageDetail.ValueType(value))
        )
    )
    with pytest.raises(WireConversionError) as raised:
        c.content_item_to_domain(proto)
    assert str(raised.value) == f"code-mode image has invalid detail value {value}"


def test_an_empty_content_item_is_refused() -> None:
    with pytest.raises(WireConversionError) as raised:
        c.content_item_to_domain(pb.ContentItem())
    assert str(raised.value) == "code-mode execution returned an empty content item"


def test_mixed_content_items_decode_in_order() -> None:
    items: list[ContentItem] = [
        InputText("a"),
        InputImage("i0"),
        InputImage("i1", ImageDetail.AUTO),
        InputImage("i2", ImageDetail.LOW),
        InputImage("i3", ImageDetail.HIGH),
        InputImage("i4", ImageDetail.ORIGINAL),
        InputAudio("s"),
    ]
    proto = wire(c.runtime_response_to_proto(Result(CellId("1"), items)))
    assert c.runtime_response_to_domain(proto).content_items == items


# -- outcomes ---------------------------------------------------------------------------------------------


@given(s.runtime_responses)
def test_runtime_responses_round_trip_with_their_duration(response: RuntimeResponse) -> None:
    back = c.runtime_response_to_domain(wire(c.runtime_response_to_proto(response)))
    assert back == response
    assert type(back) is type(response)
    assert back.host_duration_ns == response.host_duration_ns


@given(s.wait_outcomes)
def test_wait_outcomes_round_trip(wait_outcome: WaitOutcome) -> None:
    back = c.wait_outcome_to_domain(wire(c.wait_outcome_to_proto(wait_outcome)))
    assert back == wait_outcome
    assert type(back) is type(wait_outcome)
    assert back.response.host_duration_ns == wait_outcome.response.host_duration_ns


@given(s.runtime_responses)
def test_an_outcome_event_is_the_outcome_built_in_place(response: RuntimeResponse) -> None:
    event = c.outcome_event(response, 5)
    assert event.WhichOneof("event") == "outcome"
    assert event == pb.ExecuteEvent(outcome=c.runtime_response_to_proto(response, 5))
    assert wire(event).SerializeToString() == event.SerializeToString()


@given(s.content_items)
def test_a_content_item_built_in_place_is_the_one_its_constructors_give(item: ContentItem) -> None:
    if isinstance(item, InputText):
        expected = pb.ContentItem(text=pb.TextContent(text=item.text))
    elif isinstance(item, InputImage):
        image = pb.ImageContent(image_url=item.image_url)
        if item.detail is not None:
            image.detail = c._DETAIL_TO_PROTO[ImageDetail(item.detail)]
        expected = pb.ContentItem(image=image)
    else:
        expected = pb.ContentItem(audio=pb.AudioContent(audio_url=item.audio_url))
    built = c.content_item_to_proto(item)
    assert built == expected
    assert built.WhichOneof("item") == expected.WhichOneof("item")
    assert built.SerializeToString() == expected.SerializeToString()


def test_each_response_kind_is_its_oneof_variant() -> None:
    cell = CellId("1")
    assert c.runtime_response_to_proto(Yielded(cell)).WhichOneof("outcome") == "yielded"
    assert c.runtime_response_to_proto(Terminated(cell)).WhichOneof("outcome") == "terminated"
    ok = c.runtime_response_to_proto(Result(cell))
    assert ok.WhichOneof("outcome") == "completed"
    assert not ok.completed.HasField("error_text")
    failed = c.runtime_response_to_proto(Result(cell, [], ""))
    assert failed.completed.HasField("error_text")
    assert c.runtime_response_to_domain(wire(failed)) == Result(cell, [], "")


def test_the_duration_is_the_given_one_else_the_responses_else_zero() -> None:
    cell = CellId("1")
    assert c.runtime_response_to_proto(Yielded(cell)).code_mode_host_duration_ns == 0
    own = Yielded(cell, host_duration_ns=5)
    assert c.runtime_response_to_proto(own).code_mode_host_duration_ns == 5
    assert c.runtime_response_to_proto(own, 9).code_mode_host_duration_ns == 9
    assert c.runtime_response_to_proto(own, 0).code_mode_host_duration_ns == 0
    wait = c.wait_outcome_to_proto(MissingCell(Result(cell, [], "x")), 11)
    assert wait.missing_cell.code_mode_host_duration_ns == 11


@pytest.mark.parametrize(
    ("given", "sent"), [(U64_MAX, U64_MAX), (U64_MAX + 1, U64_MAX), (2**100, U64_MAX)]
)
def test_the_duration_saturates_at_the_u64_maximum(given: int, sent: int) -> None:
    proto = c.runtime_response_to_proto(Terminated(CellId("1")), given)
    assert wire(proto).code_mode_host_duration_ns == sent
    assert c.saturating_duration_ns(given) == sent


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_a_negative_or_non_integral_duration_is_refused(value: Any) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.runtime_response_to_proto(Yielded(CellId("1")), value)
    assert str(raised.value) == OUT_OF_RANGE


def test_an_outcome_without_its_oneof_is_refused() -> None:
    with pytest.raises(WireConversionError) as raised:
        c.runtime_response_to_domain(pb.ExecutionOutcome(cell_id="1"))
    assert str(raised.value) == "code-mode execution omitted its outcome"
    with pytest.raises(WireConversionError) as raised:
        c.wait_outcome_to_domain(pb.WaitResponse(live_cell=pb.ExecutionOutcome(cell_id="1")))
    assert str(raised.value) == "code-mode execution omitted its outcome"


def test_a_wait_response_without_its_state_is_refused() -> None:
    with pytest.raises(WireConversionError) as raised:
        c.wait_outcome_to_domain(pb.WaitResponse())
    assert str(raised.value) == "code-mode wait omitted its outcome"


def test_a_missing_cell_stays_missing() -> None:
    missing = MissingCell(Result(CellId("9"), [], "exec cell 9 not found"))
    proto = wire(c.wait_outcome_to_proto(missing))
    assert proto.WhichOneof("state") == "missing_cell"
    assert c.wait_outcome_to_domain(proto) == missing
    live = c.wait_outcome_to_domain(wire(c.wait_outcome_to_proto(LiveCell(Yielded(CellId("9"))))))
    assert live == LiveCell(Yielded(CellId("9")))


def test_the_content_item_error_wins_over_a_missing_outcome() -> None:
    proto = pb.ExecutionOutcome(cell_id="1", content_items=[pb.ContentItem()])
    with pytest.raises(WireConversionError) as raised:
        c.runtime_response_to_domain(proto)
    assert str(raised.value) == "code-mode execution returned an empty content item"


@pytest.mark.parametrize(
    ("cell_id", "text"),
    [
        ("", "gRPC code-mode host returned an empty cell ID"),
        ("a" * 257, "gRPC code-mode host returned cell ID exceeding 256 bytes"),
        ("é" * 128 + "a", "gRPC code-mode host returned cell ID exceeding 256 bytes"),
    ],
)
def test_bad_cell_ids_in_outcomes_fail_the_session(cell_id: str, text: str) -> None:
    # Checked before anything else in the outcome, even a missing oneof.
    for proto in (pb.ExecutionOutcome(cell_id=cell_id), outcome(cell_id=cell_id)):
        with pytest.raises(RemoteProtocolError) as raised:
            c.runtime_response_to_domain(proto)
        assert str(raised.value) == text
    for response in (
        pb.WaitResponse(live_cell=outcome(cell_id=cell_id)),
        pb.WaitResponse(missing_cell=outcome(cell_id=cell_id)),
    ):
        with pytest.raises(RemoteProtocolError) as raised:
            c.wait_outcome_to_domain(response)
        assert str(raised.value) == text


@pytest.mark.parametrize("cell_id", ["a" * 256, "é" * 128, "🙂" * 64])
def test_cell_ids_of_exactly_256_bytes_are_accepted(cell_id: str) -> None:
    assert c.runtime_response_to_domain(outcome(cell_id=cell_id)).cell_id == CellId(cell_id)


# -- tools ------------------------------------------------------------------------------------------------


@given(s.host_tool_definitions)
def test_tool_definitions_round_trip(tool: ToolDefinition) -> None:
    assert c.tool_definition_to_domain(wire(c.tool_definition_to_proto(tool))) == tool


def test_schemas_are_utf8_json_bytes_and_absent_when_none() -> None:
    tool = ToolDefinition(
        "mcp__files__read",
        ToolName.namespaced("mcp__files", "read"),
        "Read a file",
        CodeModeToolKind.FREEFORM,
        {"type": "object", "properties": {"path": {"type": "string", "title": "é"}}},
        None,
    )
    proto = c.tool_definition_to_proto(tool)
    assert proto.input_schema_json == (
        '{"type":"object","properties":{"path":{"type":"string","title":"é"}}}'.encode()
    )
    assert not proto.HasField("output_schema_json")
    assert proto.kind == pb.TOOL_KIND_FREEFORM
    assert proto.tool_name.namespace == "mcp__files"
    plain = c.tool_definition_to_proto(ToolDefinition("t", ToolName.plain("t"), ""))
    assert plain.kind == pb.TOOL_KIND_FUNCTION
    assert not plain.tool_name.HasField("namespace")
    assert not plain.HasField("input_schema_json")


def test_an_empty_namespace_is_kept_apart_from_none() -> None:
    proto = wire(c.tool_name_to_proto(ToolName("t", "")))
    assert proto.HasField("namespace")
    assert c.tool_name_to_domain(proto) == ToolName("t", "")


@pytest.mark.parametrize(
    ("schema", "detail"),
    [
        (float("nan"), "nan is not a JSON number"),
        ({"a": [float("inf")]}, "inf is not a JSON number"),
        ({"a": object()}, "Encoding objects of type object is unsupported"),
    ],
)
def test_a_schema_that_is_not_json_cannot_be_sent(schema: Any, detail: str) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.tool_definition_to_proto(
            ToolDefinition("t", ToolName.plain("t"), "", input_schema=schema)
        )
    assert str(raised.value) == f"failed to encode code-mode tool input schema: {detail}"
    with pytest.raises(WireConversionError) as raised:
        c.tool_definition_to_proto(
            ToolDefinition("t", ToolName.plain("t"), "", output_schema=schema)
        )
    assert str(raised.value) == f"failed to encode code-mode tool output schema: {detail}"


def test_a_tool_definition_without_tool_name_is_an_invalid_execute_request() -> None:
    with pytest.raises(WireConversionError) as raised:
        c.tool_definition_to_domain(pb.ToolDefinition(name="echo", kind=pb.TOOL_KIND_FUNCTION))
    assert str(raised.value) == "tool definition is missing its tool name"


@pytest.mark.parametrize("kind", [0, 3, -7])
def test_a_tool_definition_without_a_valid_kind_is_an_invalid_execute_request(kind: int) -> None:
    tool_name = pb.ToolName(name="echo")
    proto = wire(
        pb.ToolDefinition(name="echo", tool_name=tool_name, kind=pb.ToolKind.ValueType(kind))
    )
    with pytest.raises(WireConversionError) as raised:
        c.tool_definition_to_domain(proto)
    assert str(raised.value) == "tool definition has an invalid kind"


@pytest.mark.parametrize(
    ("tool", "text"),
    [
        # Upstream 0.171.0's texts and order: name, tool_name, its name, namespace, kind, schemas.
        (pb.ToolDefinition(), "code-mode tool definition name must not be empty"),
        (pb.ToolDefinition(name="a" * 257), "code-mode tool definition name exceeds 256 bytes"),
        (
            pb.ToolDefinition(name="t", kind=pb.ToolKind.ValueType(7)),
            "tool definition is missing its tool name",
        ),
        (
            pb.ToolDefinition(name="t", tool_name=pb.ToolName(), input_schema_json=b"{"),
            "code-mode tool name must not be empty",
        ),
        (
            pb.ToolDefinition(name="t", tool_name=pb.ToolName(name="é" * 128 + "a")),
            "code-mode tool name exceeds 256 bytes",
        ),
        (
            pb.ToolDefinition(name="t", tool_name=pb.ToolName(name="t", namespace="a" * 257)),
            "code-mode tool namespace exceeds 256 bytes",
        ),
        (
            pb.ToolDefinition(name="t", tool_name=pb.ToolName(name="t"), input_schema_json=b"{"),
            "tool definition has an invalid kind",
        ),
    ],
)
def test_tool_definitions_are_checked_in_upstreams_order(
    tool: pb.ToolDefinition, text: str
) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.tool_definition_to_domain(wire(tool))
    assert str(raised.value) == text


def test_tool_names_of_256_bytes_and_empty_namespaces_are_accepted() -> None:
    tool = pb.ToolDefinition(
        name="a" * 256,
        tool_name=pb.ToolName(name="b" * 256, namespace=""),
        kind=pb.TOOL_KIND_FREEFORM,
    )
    assert c.tool_definition_to_domain(wire(tool)).tool_name == ToolName("b" * 256, "")


@pytest.mark.parametrize("field", ["input_schema_json", "output_schema_json"])
@pytest.mark.parametrize(
    ("data", "detail"),
    [
        (b'{"a":1,"a":2}', "duplicate key `a` in a JSON object"),
        (b"", None),
        (b"{", None),
        (b'"\xff"', None),
        (b"NaN", None),
        (b"1 2", None),
    ],
)
def test_a_schema_that_is_not_strict_json_is_an_invalid_execute_request(
    field: str, data: bytes, detail: str | None
) -> None:
    proto = pb.ToolDefinition(
        name="echo", tool_name=pb.ToolName(name="echo"), kind=pb.TOOL_KIND_FUNCTION
    )
    setattr(proto, field, data)
    with pytest.raises(WireConversionError) as raised:
        c.tool_definition_to_domain(proto)
    prefix = f"invalid tool {field.removesuffix('_schema_json')} schema: "
    assert str(raised.value).startswith(prefix)
    if detail is not None:
        assert str(raised.value) == prefix + detail


def test_a_json_null_schema_is_none() -> None:
    proto = pb.ToolDefinition(
        name="t",
        tool_name=pb.ToolName(name="t"),
        kind=pb.TOOL_KIND_FUNCTION,
        input_schema_json=b"null",
    )
    assert c.tool_definition_to_domain(proto).input_schema is None


# -- nested tool calls --------------------------------------------------------------------------------------


@given(s.nested_calls)
def test_nested_tool_calls_round_trip(call: CodeModeNestedToolCall) -> None:
    proto = wire(
        c.tool_call_to_proto(
            call, session_id="s", execution_id="e", invocation_id="i", sequence=U64_MAX
        )
    )
    assert (proto.session_id, proto.execution_id, proto.invocation_id) == ("s", "e", "i")
    assert proto.sequence == U64_MAX
    assert not proto.HasField("traceparent")
    assert c.tool_call_to_domain(proto) == call


def test_a_tool_call_carries_its_input_as_json_and_none_as_absent() -> None:
    call = CodeModeNestedToolCall(
        CellId("2"), "tool-1", ToolName.plain("echo"), CodeModeToolKind.FUNCTION, {"value": "x"}
    )
    proto = c.tool_call_to_proto(
        call,
        session_id="s",
        execution_id="e",
        invocation_id="i",
        sequence=1,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    assert proto.input_json == b'{"value":"x"}'
    assert proto.traceparent.startswith("00-")
    none = c.tool_call_to_proto(
        CodeModeNestedToolCall(
            CellId("2"), "tool-2", ToolName.plain("echo"), CodeModeToolKind.FREEFORM
        ),
        session_id="s",
        execution_id="e",
        invocation_id="i",
        sequence=2,
    )
    assert not none.HasField("input_json")
    assert none.tool_kind == pb.TOOL_KIND_FREEFORM
    assert c.tool_call_to_domain(none).input is None


def tool_call(**fields: Any) -> pb.ToolCall:
    defaults: dict[str, Any] = {
        "cell_id": "2",
        "runtime_tool_call_id": "tool-1",
        "tool_name": pb.ToolName(name="echo"),
        "tool_kind": pb.TOOL_KIND_FUNCTION,
    }
    return wire(pb.ToolCall(**(defaults | fields)))


def test_a_tool_call_decodes_to_the_delegates_nested_call() -> None:
    proto = tool_call(
        tool_name=pb.ToolName(name="read", namespace="mcp"),
        tool_kind=pb.TOOL_KIND_FREEFORM,
        input_json=b'"patch text"',
    )
    assert c.tool_call_to_domain(proto) == CodeModeNestedToolCall(
        CellId("2"),
        "tool-1",
        ToolName.namespaced("mcp", "read"),
        CodeModeToolKind.FREEFORM,
        "patch text",
    )
    assert c.tool_call_to_domain(tool_call(input_json=b"null")).input is None


def test_a_tool_call_without_tool_name_is_answered() -> None:
    proto = tool_call()
    proto.ClearField("tool_name")
    with pytest.raises(WireConversionError) as raised:
        c.tool_call_to_domain(proto)
    assert str(raised.value) == "code-mode tool invocation omitted its tool name"


@pytest.mark.parametrize("kind", [0, 3, 42])
def test_a_tool_call_of_no_valid_kind_matches_no_enabled_tool(kind: int) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.tool_call_to_domain(tool_call(tool_name=pb.ToolName(name="hidden"), tool_kind=kind))
    assert str(raised.value) == "code-mode tool hidden is not enabled for this execution"


@pytest.mark.parametrize(
    ("data", "detail"),
    [(b'{"a":1,"a":2}', "duplicate key `a` in a JSON object"), (b"", None), (b"\xff", None)],
)
def test_a_tool_call_input_that_is_not_strict_json_is_answered(
    data: bytes, detail: str | None
) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.tool_call_to_domain(tool_call(input_json=data))
    prefix = "code-mode tool invocation contains invalid JSON: "
    assert str(raised.value).startswith(prefix)
    if detail is not None:
        assert str(raised.value) == prefix + detail


def test_a_host_cannot_send_a_non_json_input_or_an_out_of_range_sequence() -> None:
    call = CodeModeNestedToolCall(
        CellId("1"), "tool-1", ToolName.plain("t"), CodeModeToolKind.FUNCTION, float("nan")
    )
    with pytest.raises(WireConversionError) as raised:
        c.tool_call_to_proto(call, session_id="s", execution_id="e", invocation_id="i", sequence=1)
    assert str(raised.value) == (
        "code-mode tool invocation contains invalid JSON: nan is not a JSON number"
    )
    call = CodeModeNestedToolCall(
        CellId("1"), "tool-1", ToolName.plain("t"), CodeModeToolKind.FUNCTION
    )
    for sequence in (-1, U64_MAX + 1):
        with pytest.raises(WireConversionError) as raised:
            c.tool_call_to_proto(
                call, session_id="s", execution_id="e", invocation_id="i", sequence=sequence
            )
        assert str(raised.value) == OUT_OF_RANGE


# -- execute and wait requests ----------------------------------------------------------------------------


@given(s.execute_requests)
def test_execute_requests_round_trip(request: ExecuteRequest) -> None:
    proto = wire(c.execute_request_to_proto(request, session_id="s", execution_id="e"))
    assert (proto.session_id, proto.execution_id) == ("s", "e")
    assert c.execute_request_to_domain(proto) == request


def test_an_execute_request_keeps_schemas_namespaces_and_limits() -> None:
    request = ExecuteRequest(
        tool_call_id="call-1",
        source="text('hi')",
        enabled_tools=[
            ToolDefinition(
                "mcp__fs__read", ToolName.namespaced("mcp__fs", "read"), "d", input_schema={}
            )
        ],
        yield_time_ms=0,
        max_output_tokens=I32_MAX,
    )
    proto = wire(c.execute_request_to_proto(request, session_id="s", execution_id="e"))
    assert proto.HasField("yield_time_ms")
    assert proto.yield_time_ms == 0
    assert proto.max_output_tokens == I32_MAX
    assert proto.enabled_tools[0].input_schema_json == b"{}"
    assert proto.enabled_tools[0].tool_name.namespace == "mcp__fs"
    assert c.execute_request_to_domain(proto) == request
    bare = wire(
        c.execute_request_to_proto(ExecuteRequest("call-1", "1"), session_id="s", execution_id="e")
    )
    assert not bare.HasField("yield_time_ms")
    assert not bare.HasField("max_output_tokens")
    assert c.execute_request_to_domain(bare) == ExecuteRequest("call-1", "1")


@pytest.mark.parametrize("field", ["yield_time_ms", "max_output_tokens"])
@pytest.mark.parametrize("value", [-1, U64_MAX + 1, True])
def test_execute_request_integers_out_of_range_are_refused(field: str, value: int) -> None:
    changes: dict[str, Any] = {field: value}
    request = dataclasses.replace(ExecuteRequest("call-1", "1"), **changes)
    with pytest.raises(WireConversionError) as raised:
        c.execute_request_to_proto(request, session_id="s", execution_id="e")
    assert str(raised.value) == OUT_OF_RANGE


@pytest.mark.parametrize("value", [I32_MAX + 1, U64_MAX])
def test_max_output_tokens_past_an_i32_saturate(value: int) -> None:
    # A uint64 on this wire, an i32 in the domain: upstream 0.171.0 accepts any value.
    proto = pb.ExecuteRequest(tool_call_id="c", max_output_tokens=value)
    assert c.execute_request_to_domain(proto).max_output_tokens == I32_MAX


@pytest.mark.parametrize(
    ("tool_call_id", "text"),
    [
        ("", "code-mode tool call ID must not be empty"),
        ("x" * 257, "code-mode tool call ID exceeds 256 bytes"),
    ],
)
def test_an_execute_request_with_a_bad_tool_call_id_is_refused(
    tool_call_id: str, text: str
) -> None:
    proto = pb.ExecuteRequest(tool_call_id=tool_call_id, enabled_tools=[pb.ToolDefinition()])
    with pytest.raises(WireConversionError) as raised:
        c.execute_request_to_domain(proto)
    assert str(raised.value) == text


def test_the_first_bad_tool_definition_names_the_error() -> None:
    good = pb.ToolDefinition(name="a", tool_name=pb.ToolName(name="a"), kind=pb.TOOL_KIND_FUNCTION)
    proto = pb.ExecuteRequest(
        tool_call_id="c",
        enabled_tools=[
            good,
            pb.ToolDefinition(name="b", kind=pb.TOOL_KIND_FUNCTION),
            pb.ToolDefinition(name="c"),
        ],
    )
    with pytest.raises(WireConversionError) as raised:
        c.execute_request_to_domain(proto)
    assert str(raised.value) == "tool definition is missing its tool name"


@given(s.wait_requests)
def test_wait_requests_round_trip(request: WaitRequest) -> None:
    proto = wire(c.wait_request_to_proto(request, session_id="s", wait_id="w"))
    assert (proto.session_id, proto.wait_id) == ("s", "w")
    assert c.wait_request_to_domain(proto) == request


def test_wait_requests_refuse_out_of_range_times_and_bad_cell_ids() -> None:
    for value in (-1, U64_MAX + 1):
        with pytest.raises(WireConversionError) as raised:
            c.wait_request_to_proto(WaitRequest(CellId("1"), value), session_id="s", wait_id="w")
        assert str(raised.value) == OUT_OF_RANGE
    with pytest.raises(WireConversionError) as raised:
        c.wait_request_to_domain(pb.WaitRequest(cell_id=""))
    assert str(raised.value) == "code-mode cell ID must not be empty"


# -- session limits ---------------------------------------------------------------------------------------


@given(s.limits)
def test_limits_round_trip(limits: CodeModeSessionCellExecutionLimits) -> None:
    assert c.limits_to_domain(wire(c.limits_to_proto(limits))) == limits


def test_limits_are_sent_only_when_one_is_set() -> None:
    assert not c.open_session_request().HasField("cell_execution_limits")
    default = CodeModeSessionCellExecutionLimits()
    assert not c.open_session_request(default).HasField("cell_execution_limits")
    request = wire(c.open_session_request(CodeModeSessionCellExecutionLimits(0, None)))
    assert request.HasField("cell_execution_limits")
    limits = request.cell_execution_limits
    assert limits.HasField("max_yield_time_ms")
    assert not limits.HasField("max_heap_size_bytes")
    assert c.limits_to_domain(limits) == CodeModeSessionCellExecutionLimits(0, None)


def test_a_heap_limit_of_zero_is_copied_for_the_runtime_to_refuse() -> None:
    proto = pb.SessionCellExecutionLimits(max_heap_size_bytes=0)
    assert c.limits_to_domain(proto) == CodeModeSessionCellExecutionLimits(None, 0)


@pytest.mark.parametrize("value", [-1, U64_MAX + 1, True])
def test_a_heap_limit_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.limits_to_proto(CodeModeSessionCellExecutionLimits(None, value))
    assert str(raised.value) == f"invalid code-mode heap size limit: {OUT_OF_RANGE}"


@pytest.mark.parametrize("value", [-1, U64_MAX + 1])
def test_a_yield_limit_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(WireConversionError) as raised:
        c.limits_to_proto(CodeModeSessionCellExecutionLimits(value, None))
    assert str(raised.value) == OUT_OF_RANGE


# -- tool results ------------------------------------------------------------------------------------------


def test_a_returned_value_is_sent_as_output_json() -> None:
    request = c.complete_tool_call_request("s", "i", ToolReturned({"ok": [1, "é"]}))
    assert (request.session_id, request.invocation_id) == ("s", "i")
    assert request.WhichOneof("outcome") == "succeeded"
    assert request.succeeded.output_json == '{"ok":[1,"é"]}'.encode()
    null = c.complete_tool_call_request("s", "i", ToolReturned(None))
    assert null.succeeded.output_json == b"null"


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        (float("nan"), "nan is not a JSON number"),
        ({"a": object()}, "Encoding objects of type object is unsupported"),
    ],
)
def test_a_value_that_is_not_json_becomes_a_failure(value: Any, detail: str) -> None:
    request = c.complete_tool_call_request("s", "i", ToolReturned(value))
    assert request.WhichOneof("outcome") == "failed"
    assert request.failed.message == f"failed to encode code-mode tool result: {detail}"
    with pytest.raises(WireConversionError) as raised:
        c.encode_tool_output(value)
    assert str(raised.value) == f"failed to encode code-mode tool result: {detail}"


def test_a_failure_is_sent_as_its_message() -> None:
    request = c.complete_tool_call_request("s", "i", CallbackFailed("boom"))
    assert request.WhichOneof("outcome") == "failed"
    assert request.failed.message == "boom"


def test_failure_messages_up_to_64_kib_are_sent_unchanged() -> None:
    for message in ("", "a" * 65_536, "é" * 32_768):
        assert c.truncate_tool_error(message) == message
        assert c.tool_call_failed("s", "i", message).failed.message == message


@pytest.mark.parametrize(
    ("unit", "count"),
    [("a", 65_537), ("é", 40_000), ("€", 30_000), ("🙂", 20_000), ("ab🙂", 11_000)],
)
def test_longer_failure_messages_are_cut_on_a_character_boundary(unit: str, count: int) -> None:
    message = unit * count
    cut = c.truncate_tool_error(message)
    encoded = cut.encode("utf-8")
    assert len(encoded) <= 65_536
    assert cut.endswith("... [truncated]")
    kept = cut.removesuffix("... [truncated]")
    assert message.startswith(kept)
    # The longest prefix that fits: one more character would not.
    assert len(encoded) + len(message[len(kept)].encode("utf-8")) > 65_536
    request = wire(c.complete_tool_call_request("s", "i", CallbackFailed(message)))
    assert request.failed.message == cut


def test_a_lone_surrogate_in_a_failure_message_is_replaced() -> None:
    assert c.truncate_tool_error("a\ud800b") == "a\ufffdb"
    request = wire(c.complete_tool_call_request("s", "i", CallbackFailed("x\udfff")))
    assert request.failed.message == "x\ufffd"


def test_a_completion_over_the_limit_is_replaced_with_the_oversize_failure() -> None:
    result = ToolReturned("x" * 200)
    original = c.tool_call_succeeded("s", "i", c.encode_tool_output(result.value))
    size = original.ByteSize()
    assert c.complete_tool_call_request("s", "i", result, limit=size) == original
    replaced = c.complete_tool_call_request("s", "i", result, limit=size - 1)
    assert (replaced.session_id, replaced.invocation_id) == ("s", "i")
    assert replaced.failed.message == (
        f"code-mode tool result of {size} encoded bytes exceeds the gRPC message limit of "
        f"{size - 1} bytes"
    )


@pytest.mark.slow
def test_the_64_mib_limit_counts_the_whole_request() -> None:
    session_id, invocation_id = "3f2b8f8e-4a52-4a8e-9d61-1f1c5e0b8f11", "x" * 36

    def request_of(length: int) -> pb.CompleteToolCallRequest:
        return c.tool_call_succeeded(session_id, invocation_id, b"1" * length)

    envelope = request_of(MAX_MESSAGE_BYTES - 1000).ByteSize() - (MAX_MESSAGE_BYTES - 1000)
    exact = request_of(MAX_MESSAGE_BYTES - envelope)
    assert exact.ByteSize() == MAX_MESSAGE_BYTES
    assert c.fit_message_limit(exact) is exact
    over = request_of(MAX_MESSAGE_BYTES - envelope + 1)
    replaced = c.fit_message_limit(over)
    assert replaced.failed.message == (
        f"code-mode tool result of {MAX_MESSAGE_BYTES + 1} encoded bytes exceeds the gRPC "
        "message limit of 67108864 bytes"
    )
    assert replaced.invocation_id == invocation_id
