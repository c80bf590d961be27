"""The generated descriptor is the interface ``grpc.md`` §2 pins: every message, field, number,
type, presence and oneof, both enums, and the service's rpcs, written out here from the spec."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2

from codemode.grpc_stubs import v1_pb2_grpc
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import PROTO_PACKAGE, SERVICE_NAME, SERVICE_PATH_PREFIX

# (field, number, type, label): type as spelled in the proto; label "" (singular), "optional"
# (proto3 optional), "repeated" or "oneof NAME". Fields in declaration order.
MESSAGES: list[tuple[str, list[tuple[str, int, str, str]]]] = [
    (
        "OpenSessionRequest",
        [("cell_execution_limits", 1, "SessionCellExecutionLimits", "optional")],
    ),
    (
        "SessionCellExecutionLimits",
        [
            ("max_yield_time_ms", 1, "uint64", "optional"),
            ("max_heap_size_bytes", 2, "uint64", "optional"),
        ],
    ),
    (
        "SessionEvent",
        [
            ("opened", 1, "SessionOpened", "oneof event"),
            ("tool_call_cancelled", 2, "ToolCallCancelled", "oneof event"),
            ("notification", 3, "Notification", "oneof event"),
            ("notification_cancelled", 4, "NotificationCancelled", "oneof event"),
            ("cell_closed", 5, "CellClosed", "oneof event"),
        ],
    ),
    ("SessionOpened", [("session_id", 1, "string", "")]),
    ("CloseSessionRequest", [("session_id", 1, "string", "")]),
    ("CloseSessionResponse", []),
    (
        "SubscribeToToolCallsRequest",
        [("session_id", 1, "string", ""), ("tool_names", 2, "ToolName", "repeated")],
    ),
    (
        "ToolCall",
        [
            ("session_id", 1, "string", ""),
            ("execution_id", 2, "string", ""),
            ("cell_id", 3, "string", ""),
            ("invocation_id", 4, "string", ""),
            ("runtime_tool_call_id", 5, "string", ""),
            ("tool_name", 6, "ToolName", ""),
            ("tool_kind", 7, "ToolKind", ""),
            ("input_json", 8, "bytes", "optional"),
            ("sequence", 9, "uint64", ""),
            ("traceparent", 10, "string", "optional"),
        ],
    ),
    (
        "CompleteToolCallRequest",
        [
            ("session_id", 1, "string", ""),
            ("invocation_id", 2, "string", ""),
            ("succeeded", 3, "ToolCallSucceeded", "oneof outcome"),
            ("failed", 4, "ToolCallFailed", "oneof outcome"),
        ],
    ),
    ("ToolCallSucceeded", [("output_json", 1, "bytes", "")]),
    ("ToolCallFailed", [("message", 1, "string", "")]),
    ("CompleteToolCallResponse", []),
    ("ToolCallCancelled", [("invocation_id", 1, "string", "")]),
    (
        "Notification",
        [
            ("notification_id", 1, "string", ""),
            ("execution_id", 2, "string", ""),
            ("cell_id", 3, "string", ""),
            ("call_id", 4, "string", ""),
            ("text", 5, "string", ""),
        ],
    ),
    ("NotificationCancelled", [("notification_id", 1, "string", "")]),
    (
        "AcknowledgeNotificationRequest",
        [("session_id", 1, "string", ""), ("notification_id", 2, "string", "")],
    ),
    ("AcknowledgeNotificationResponse", []),
    (
        "CellClosed",
        [
            ("execution_id", 1, "string", ""),
            ("cell_id", 2, "string", ""),
            ("final_tool_call_sequence", 3, "uint64", ""),
        ],
    ),
    (
        "ExecuteRequest",
        [
            ("session_id", 1, "string", ""),
            ("execution_id", 2, "string", ""),
            ("tool_call_id", 3, "string", ""),
            ("source", 4, "string", ""),
            ("enabled_tools", 5, "ToolDefinition", "repeated"),
            ("yield_time_ms", 6, "uint64", "optional"),
            ("max_output_tokens", 7, "uint64", "optional"),
        ],
    ),
    (
        "ExecuteEvent",
        [
            ("started", 1, "ExecutionStarted", "oneof event"),
            ("outcome", 2, "ExecutionOutcome", "oneof event"),
        ],
    ),
    ("ExecutionStarted", [("execution_id", 1, "string", ""), ("cell_id", 2, "string", "")]),
    (
        "WaitRequest",
        [
            ("session_id", 1, "string", ""),
            ("cell_id", 2, "string", ""),
            ("wait_id", 3, "string", ""),
            ("yield_time_ms", 4, "uint64", ""),
        ],
    ),
    (
        "WaitResponse",
        [
            ("live_cell", 1, "ExecutionOutcome", "oneof state"),
            ("missing_cell", 2, "ExecutionOutcome", "oneof state"),
        ],
    ),
    ("CancelWaitRequest", [("session_id", 1, "string", ""), ("wait_id", 2, "string", "")]),
    ("CancelWaitResponse", []),
    (
        "YieldObservationRequest",
        [
            ("session_id", 1, "string", ""),
            ("execution_id", 2, "string", "oneof observation"),
            ("wait_id", 3, "string", "oneof observation"),
        ],
    ),
    ("YieldObservationResponse", []),
    ("TerminateRequest", [("session_id", 1, "string", ""), ("cell_id", 2, "string", "")]),
    (
        "ExecutionOutcome",
        [
            ("cell_id", 1, "string", ""),
            ("content_items", 2, "ContentItem", "repeated"),
            ("code_mode_host_duration_ns", 6, "uint64", ""),
            ("yielded", 3, "ExecutionYielded", "oneof outcome"),
            ("terminated", 4, "ExecutionTerminated", "oneof outcome"),
            ("completed", 5, "ExecutionCompleted", "oneof outcome"),
        ],
    ),
    ("ExecutionYielded", []),
    ("ExecutionTerminated", []),
    ("ExecutionCompleted", [("error_text", 1, "string", "optional")]),
    (
        "ToolDefinition",
        [
            ("name", 1, "string", ""),
            ("tool_name", 2, "ToolName", ""),
            ("description", 3, "string", ""),
            ("kind", 4, "ToolKind", ""),
            ("input_schema_json", 5, "bytes", "optional"),
            ("output_schema_json", 6, "bytes", "optional"),
        ],
    ),
    ("ToolName", [("name", 1, "string", ""), ("namespace", 2, "string", "optional")]),
    (
        "ContentItem",
        [
            ("text", 1, "TextContent", "oneof item"),
            ("image", 2, "ImageContent", "oneof item"),
            ("audio", 3, "AudioContent", "oneof item"),
        ],
    ),
    ("TextContent", [("text", 1, "string", "")]),
    ("ImageContent", [("image_url", 1, "string", ""), ("detail", 2, "ImageDetail", "optional")]),
    ("AudioContent", [("audio_url", 1, "string", "")]),
]

ENUMS = [
    (
        "ToolKind",
        [("TOOL_KIND_UNSPECIFIED", 0), ("TOOL_KIND_FUNCTION", 1), ("TOOL_KIND_FREEFORM", 2)],
    ),
    (
        "ImageDetail",
        [
            ("IMAGE_DETAIL_UNSPECIFIED", 0),
            ("IMAGE_DETAIL_AUTO", 1),
            ("IMAGE_DETAIL_LOW", 2),
            ("IMAGE_DETAIL_HIGH", 3),
            ("IMAGE_DETAIL_ORIGINAL", 4),
        ],
    ),
]

# (rpc, request, response, server streaming), in declaration order; no rpc streams requests.
RPCS = [
    ("OpenSession", "OpenSessionRequest", "SessionEvent", True),
    ("CloseSession", "CloseSessionRequest", "CloseSessionResponse", False),
    ("SubscribeToToolCalls", "SubscribeToToolCallsRequest", "ToolCall", True),
    ("CompleteToolCall", "CompleteToolCallRequest", "CompleteToolCallResponse", False),
    (
        "AcknowledgeNotification",
        "AcknowledgeNotificationRequest",
        "AcknowledgeNotificationResponse",
        False,
    ),
    ("Execute", "ExecuteRequest", "ExecuteEvent", True),
    ("Wait", "WaitRequest", "WaitResponse", False),
    ("YieldObservation", "YieldObservationRequest", "YieldObservationResponse", False),
    ("CancelWait", "CancelWaitRequest", "CancelWaitResponse", False),
    ("Terminate", "TerminateRequest", "WaitResponse", False),
]

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {F.TYPE_STRING: "string", F.TYPE_UINT64: "uint64", F.TYPE_BYTES: "bytes"}
PREFIX = f".{PROTO_PACKAGE}."


def file_proto() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)


def type_of(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
        assert field.type_name.startswith(PREFIX), field.type_name
        return field.type_name.removeprefix(PREFIX)
    return SCALARS[field.type]


def label_of(message: descriptor_pb2.DescriptorProto, field: F) -> str:
    if field.label == F.LABEL_REPEATED:
        return "repeated"
    if field.proto3_optional:
        return "optional"
    if field.HasField("oneof_index"):
        return f"oneof {message.oneof_decl[field.oneof_index].name}"
    return ""


def test_the_file_is_codex_code_mode_v1_in_proto3_with_no_imports_or_options() -> None:
    proto = file_proto()
    assert proto.name == "codex/code_mode/v1.proto"
    assert proto.package == PROTO_PACKAGE == "codex.code_mode.v1"
    assert proto.syntax == "proto3"
    assert list(proto.dependency) == []
    assert not proto.HasField("options")


def test_every_message_field_number_type_and_presence_is_as_specified() -> None:
    proto = file_proto()
    found = [
        (
            message.name,
            [(f.name, f.number, type_of(f), label_of(message, f)) for f in message.field],
        )
        for message in proto.message_type
    ]
    assert found == MESSAGES
    for message in proto.message_type:
        assert not message.nested_type and not message.enum_type, message.name
        assert not message.HasField("options"), message.name


def test_both_enums_are_as_specified() -> None:
    found = [
        (enum.name, [(value.name, value.number) for value in enum.value])
        for enum in file_proto().enum_type
    ]
    assert found == ENUMS


def test_the_service_has_the_ten_rpcs_as_specified() -> None:
    (service,) = file_proto().service
    assert f"{PROTO_PACKAGE}.{service.name}" == SERVICE_NAME == "codex.code_mode.v1.CodeModeHost"
    found = [
        (
            method.name,
            method.input_type.removeprefix(PREFIX),
            method.output_type.removeprefix(PREFIX),
            method.server_streaming,
        )
        for method in service.method
    ]
    assert found == RPCS
    assert not any(method.client_streaming for method in service.method)
    assert SERVICE_PATH_PREFIX == "/codex.code_mode.v1.CodeModeHost/"


def test_the_generated_modules_are_package_modules() -> None:
    assert pb.ExecuteRequest.__module__ == "codemode.protocol.grpc.v1_pb2"
    assert pb.DESCRIPTOR.name == "codex/code_mode/v1.proto"
    assert vars(v1_pb2_grpc)["codex_dot_code__mode_dot_v1__pb2"] is pb
    assert pb.ExecuteRequest.DESCRIPTOR.full_name == "codex.code_mode.v1.ExecuteRequest"


class _Host(v1_pb2_grpc.CodeModeHostServicer):
    def Wait(self, request: pb.WaitRequest, context: Any) -> pb.WaitResponse:
        outcome = pb.ExecutionOutcome(cell_id=request.cell_id, code_mode_host_duration_ns=7)
        outcome.yielded.SetInParent()
        return pb.WaitResponse(live_cell=outcome)

    def Execute(self, request: pb.ExecuteRequest, context: Any) -> Any:
        yield pb.ExecuteEvent(started=pb.ExecutionStarted(execution_id=request.execution_id))


def test_the_service_bindings_carry_calls_over_a_real_channel() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    # The other rpcs are left out on purpose (UNIMPLEMENTED below); the stubs make them abstract.
    v1_pb2_grpc.add_CodeModeHostServicer_to_server(_Host(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = v1_pb2_grpc.CodeModeHostStub(channel)
            response = stub.Wait(pb.WaitRequest(cell_id="7"), timeout=10)
            assert response.WhichOneof("state") == "live_cell"
            assert response.live_cell.cell_id == "7"
            assert response.live_cell.code_mode_host_duration_ns == 7
            events = list(stub.Execute(pb.ExecuteRequest(execution_id="e"), timeout=10))
            assert [event.started.execution_id for event in events] == ["e"]
            with pytest.raises(grpc.RpcError) as raised:
                stub.Terminate(pb.TerminateRequest(), timeout=10)
            assert isinstance(raised.value, grpc.Call)
            assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)
