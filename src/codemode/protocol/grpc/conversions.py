"""Domain ⇄ gRPC message conversions (``grpc.md`` §10, §6.3): field by field, never truncating.

Direction and blame follow who builds and who reads each message:

* ``…_to_proto`` builds a message from domain values. An integer that does not fit its field
  raises :class:`WireConversionError` (``out of range integral type conversion attempted``, or
  the specification's own text where it has one); only ``code_mode_host_duration_ns`` saturates.
* ``…_to_domain`` reads a message the peer sent. A message that cannot become a domain value
  raises :class:`WireConversionError` with the exact §10/§12 text: on the client the call fails,
  on the host the request is answered ``INVALID_ARGUMENT``. A cell id the host returned empty or
  over 256 bytes raises :class:`~codemode.errors.RemoteProtocolError` instead (§10 †: the session
  fails too).

Identifiers that are not part of a domain value (``session_id``, ``execution_id``, ``wait_id``,
``invocation_id``, …) are passed in separately and checked with
:mod:`codemode.protocol.grpc.identifiers`, in the order the glue needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from codemode.errors import WireConversionError
from codemode.protocol import strict_json
from codemode.protocol.constants import I32_MAX, U64_MAX
from codemode.protocol.delegation import CallbackFailed, ToolReturned
from codemode.protocol.grpc import texts
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import (
    MAX_IDENTIFIER_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_TOOL_ERROR_MESSAGE_BYTES,
)
from codemode.protocol.grpc.identifiers import (
    check_host_identifier,
    check_request_identifier,
    identifier_bytes,
)
from codemode.protocol.surrogates import well_formed
from codemode.protocol.types import (
    JSON,
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

__all__ = [
    "complete_tool_call_request",
    "content_item_to_domain",
    "content_item_to_proto",
    "encode_tool_output",
    "execute_request_to_domain",
    "execute_request_to_proto",
    "fit_message_limit",
    "limits_to_domain",
    "limits_to_proto",
    "open_session_request",
    "outcome_event",
    "runtime_response_to_domain",
    "runtime_response_to_proto",
    "saturating_duration_ns",
    "tool_call_failed",
    "tool_call_succeeded",
    "tool_call_to_domain",
    "tool_call_to_proto",
    "tool_definition_to_domain",
    "tool_definition_to_proto",
    "tool_name_to_domain",
    "tool_name_to_proto",
    "truncate_tool_error",
    "wait_outcome_to_domain",
    "wait_outcome_to_proto",
    "wait_request_to_domain",
    "wait_request_to_proto",
]

_KIND_TO_PROTO: Final = {
    CodeModeToolKind.FUNCTION: pb.TOOL_KIND_FUNCTION,
    CodeModeToolKind.FREEFORM: pb.TOOL_KIND_FREEFORM,
}
_KIND_TO_DOMAIN: Final = {int(value): kind for kind, value in _KIND_TO_PROTO.items()}

_DETAIL_TO_PROTO: Final = {
    ImageDetail.AUTO: pb.IMAGE_DETAIL_AUTO,
    ImageDetail.LOW: pb.IMAGE_DETAIL_LOW,
    ImageDetail.HIGH: pb.IMAGE_DETAIL_HIGH,
    ImageDetail.ORIGINAL: pb.IMAGE_DETAIL_ORIGINAL,
}
_DETAIL_TO_DOMAIN: Final = {int(value): detail for detail, value in _DETAIL_TO_PROTO.items()}

_TRUNCATED_SUFFIX_BYTES: Final = texts.TRUNCATED_SUFFIX.encode("utf-8")


# -- integers -------------------------------------------------------------------------------------


def _u64(value: int) -> int:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise WireConversionError()
    return value


def _optional_u64(value: int | None) -> int | None:
    return None if value is None else _u64(value)


def saturating_duration_ns(value: int) -> int:
    """A host duration in nanoseconds as ``code_mode_host_duration_ns``: capped at 2^64 - 1."""
    if type(value) is not int or value < 0:
        raise WireConversionError()
    return min(value, U64_MAX)


# -- JSON payloads ----------------------------------------------------------------------------------


def _json_bytes(value: JSON, encode: Callable[[Any], bytes] = strict_json.dumps) -> bytes:
    """``value`` as compact UTF-8 JSON, as ``encode`` writes it (another writer must give the same
    bytes); :class:`ValueError` (the detail) if it is not JSON."""
    try:
        encoded = encode(value)
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(str(error)) from None
    if b"null" in encoded and (number := strict_json.non_finite_number(value)) is not None:
        raise ValueError(f"{number} is not a JSON number")
    return encoded


def _optional_json_bytes(value: JSON, error_text: Callable[[str], str]) -> bytes | None:
    if value is None:
        return None
    try:
        return _json_bytes(value)
    except ValueError as error:
        raise WireConversionError(error_text(str(error))) from None


# -- content items ----------------------------------------------------------------------------------


def content_item_to_proto(item: ContentItem) -> pb.ContentItem:
    """Convert a content item; an image's ``detail`` of ``None`` leaves the field absent."""
    message = pb.ContentItem()
    _fill_content_item(message, item)
    return message


# A message handed to another's constructor (or appended to a repeated field) is copied whole:
# an item of 42 M characters cost the event loop about 0.1 s per level of nesting. Messages that
# carry a cell's texts are built in place instead, each string set once where it stays.


def _fill_content_item(message: pb.ContentItem, item: ContentItem) -> None:
    if isinstance(item, InputText):
        message.text.SetInParent()
        message.text.text = item.text
    elif isinstance(item, InputImage):
        image = message.image
        image.SetInParent()
        image.image_url = item.image_url
        if item.detail is not None:
            image.detail = _DETAIL_TO_PROTO[ImageDetail(item.detail)]
    else:
        message.audio.SetInParent()
        message.audio.audio_url = item.audio_url


def content_item_to_domain(item: pb.ContentItem) -> ContentItem:
    """Convert a content item; no variant, or an image detail that is present but unspecified or
    unknown, is an error."""
    kind = item.WhichOneof("item")
    if kind == "text":
        return InputText(item.text.text)
    if kind == "image":
        image = item.image
        if not image.HasField("detail"):
            return InputImage(image.image_url)
        value = int(image.detail)
        detail = _DETAIL_TO_DOMAIN.get(value)
        if detail is None:
            raise WireConversionError(texts.invalid_image_detail(value))
        return InputImage(image.image_url, detail)
    if kind == "audio":
        return InputAudio(item.audio.audio_url)
    raise WireConversionError(texts.EMPTY_CONTENT_ITEM)


# -- outcomes ---------------------------------------------------------------------------------------


def runtime_response_to_proto(
    response: RuntimeResponse, host_duration_ns: int | None = None
) -> pb.ExecutionOutcome:
    """Convert a runtime response to an ``ExecutionOutcome``.

    ``code_mode_host_duration_ns`` is ``host_duration_ns`` when given, else the response's own,
    else 0 (the field is always set); it saturates at 2^64 - 1.
    """
    outcome = pb.ExecutionOutcome()
    _fill_outcome(outcome, response, host_duration_ns)
    return outcome


def outcome_event(
    response: RuntimeResponse, host_duration_ns: int | None = None
) -> pb.ExecuteEvent:
    """An ``ExecuteEvent`` carrying the ``outcome`` of :func:`runtime_response_to_proto`."""
    event = pb.ExecuteEvent()
    _fill_outcome(event.outcome, response, host_duration_ns)
    return event


def _fill_outcome(
    outcome: pb.ExecutionOutcome, response: RuntimeResponse, host_duration_ns: int | None
) -> None:
    duration = response.host_duration_ns if host_duration_ns is None else host_duration_ns
    outcome.SetInParent()
    outcome.cell_id = response.cell_id.value
    for item in response.content_items:
        _fill_content_item(outcome.content_items.add(), item)
    outcome.code_mode_host_duration_ns = 0 if duration is None else saturating_duration_ns(duration)
    if isinstance(response, Yielded):
        outcome.yielded.SetInParent()
    elif isinstance(response, Terminated):
        outcome.terminated.SetInParent()
    else:
        completed = outcome.completed
        completed.SetInParent()
        if response.error_text is not None:
            completed.error_text = response.error_text


def runtime_response_to_domain(outcome: pb.ExecutionOutcome) -> RuntimeResponse:
    """Convert an ``ExecutionOutcome`` (client side): the cell id first (empty or over 256 bytes
    fails the session), then the items, then the outcome oneof (missing is an error)."""
    cell_id = CellId(check_host_identifier("cell ID", outcome.cell_id))
    items = [content_item_to_domain(item) for item in outcome.content_items]
    duration = outcome.code_mode_host_duration_ns
    kind = outcome.WhichOneof("outcome")
    if kind == "yielded":
        return Yielded(cell_id, items, host_duration_ns=duration)
    if kind == "terminated":
        return Terminated(cell_id, items, host_duration_ns=duration)
    if kind == "completed":
        completed = outcome.completed
        error_text = completed.error_text if completed.HasField("error_text") else None
        return Result(cell_id, items, error_text, host_duration_ns=duration)
    raise WireConversionError(texts.EXECUTION_OMITTED_OUTCOME)


def wait_outcome_to_proto(
    outcome: WaitOutcome, host_duration_ns: int | None = None
) -> pb.WaitResponse:
    """Convert a wait outcome: ``live_cell`` or ``missing_cell`` (duration as for responses)."""
    message = pb.WaitResponse()
    state = message.live_cell if isinstance(outcome, LiveCell) else message.missing_cell
    _fill_outcome(state, outcome.response, host_duration_ns)
    return message


def wait_outcome_to_domain(response: pb.WaitResponse) -> WaitOutcome:
    """Convert a ``WaitResponse``; one without its ``state`` is an error."""
    state = response.WhichOneof("state")
    if state == "live_cell":
        return LiveCell(runtime_response_to_domain(response.live_cell))
    if state == "missing_cell":
        return MissingCell(runtime_response_to_domain(response.missing_cell))
    raise WireConversionError(texts.WAIT_OMITTED_OUTCOME)


# -- tools ------------------------------------------------------------------------------------------


def tool_name_to_proto(name: ToolName) -> pb.ToolName:
    """Copy a tool name (``None`` namespace leaves the field absent)."""
    proto = pb.ToolName(name=name.name)
    if name.namespace is not None:
        proto.namespace = name.namespace
    return proto


def tool_name_to_domain(name: pb.ToolName) -> ToolName:
    """Copy a tool name (an absent namespace is ``None``; an empty one stays empty)."""
    return ToolName(name.name, name.namespace if name.HasField("namespace") else None)


def tool_definition_to_proto(tool: ToolDefinition) -> pb.ToolDefinition:
    """Convert a tool definition (client side); schemas become UTF-8 JSON bytes, absent when
    ``None``, and one that is not JSON fails with ``failed to encode code-mode tool … schema``."""
    proto = pb.ToolDefinition(
        name=tool.name,
        tool_name=tool_name_to_proto(tool.tool_name),
        description=tool.description,
        kind=_KIND_TO_PROTO[CodeModeToolKind(tool.kind)],
    )
    input_schema = _optional_json_bytes(tool.input_schema, texts.tool_input_schema_not_encodable)
    if input_schema is not None:
        proto.input_schema_json = input_schema
    output_schema = _optional_json_bytes(tool.output_schema, texts.tool_output_schema_not_encodable)
    if output_schema is not None:
        proto.output_schema_json = output_schema
    return proto


def _schema_to_domain(which: str, present: bool, data: bytes) -> JSON:
    if not present:
        return None
    try:
        return strict_json.loads(data)
    except strict_json.JSONError as error:
        raise WireConversionError(texts.tool_schema_not_json(which, str(error))) from None


def _check_bounded(what: str, value: str) -> None:
    if not value:
        raise WireConversionError(texts.tool_field_empty(what))
    if identifier_bytes(value) > MAX_IDENTIFIER_BYTES:
        raise WireConversionError(texts.tool_field_too_long(what))


def tool_definition_to_domain(tool: pb.ToolDefinition) -> ToolDefinition:
    """Convert a tool definition (host side), checked in upstream 0.171.0's order and with its
    texts: ``name`` non-empty and at most 256 bytes, ``tool_name`` present with such a name, a
    namespace of at most 256 bytes (empty is allowed), a kind other than
    ``TOOL_KIND_UNSPECIFIED``, then the input and the output schema strict JSON."""
    _check_bounded("tool definition name", tool.name)
    if not tool.HasField("tool_name"):
        raise WireConversionError(texts.TOOL_DEFINITION_MISSING_TOOL_NAME)
    _check_bounded("tool name", tool.tool_name.name)
    namespace = tool.tool_name.namespace
    if identifier_bytes(namespace) > MAX_IDENTIFIER_BYTES:
        raise WireConversionError(texts.tool_field_too_long("tool namespace"))
    kind = _KIND_TO_DOMAIN.get(int(tool.kind))
    if kind is None:
        raise WireConversionError(texts.TOOL_DEFINITION_INVALID_KIND)
    input_schema = _schema_to_domain(
        "input", tool.HasField("input_schema_json"), tool.input_schema_json
    )
    output_schema = _schema_to_domain(
        "output", tool.HasField("output_schema_json"), tool.output_schema_json
    )
    return ToolDefinition(
        tool.name,
        tool_name_to_domain(tool.tool_name),
        tool.description,
        kind,
        input_schema,
        output_schema,
    )


def tool_call_to_proto(
    call: CodeModeNestedToolCall,
    *,
    session_id: str,
    execution_id: str,
    invocation_id: str,
    sequence: int,
    traceparent: str | None = None,
    input_json: bytes | None = None,
) -> pb.ToolCall:
    """Build a ``ToolCall`` (host side) from a cell's nested call and the ids that route it.

    ``None`` input leaves ``input_json`` absent; ``sequence`` must fit a uint64. ``input_json``:
    the input encoded already (:func:`tool_input_json`), in place of encoding it here.
    """
    proto = pb.ToolCall(
        session_id=session_id,
        execution_id=execution_id,
        cell_id=call.cell_id.value,
        invocation_id=invocation_id,
        runtime_tool_call_id=call.runtime_tool_call_id,
        tool_name=tool_name_to_proto(call.tool_name),
        tool_kind=_KIND_TO_PROTO[CodeModeToolKind(call.tool_kind)],
        sequence=_u64(sequence),
    )
    if input_json is not None:
        proto.input_json = input_json
    elif call.input is not None:
        proto.input_json = tool_input_json(call.input)
    if traceparent is not None:
        proto.traceparent = traceparent
    return proto


def tool_input_json(value: JSON, encode: Callable[[Any], bytes] = strict_json.dumps) -> bytes:
    """A nested call's input as its ``input_json``, as ``encode`` writes it (a large one is
    written a piece at a time, off the event loop); :class:`WireConversionError` if it is not
    JSON."""
    try:
        return _json_bytes(value, encode)
    except ValueError as error:
        raise WireConversionError(texts.tool_call_input_not_json(str(error))) from None


def tool_call_to_domain(call: pb.ToolCall) -> CodeModeNestedToolCall:
    """Convert a ``ToolCall`` (client side) to the delegate's nested call.

    Each failure is a text the client answers the invocation with (§13.4), not a session failure:
    no ``tool_name``; a kind that is unspecified or unknown (no enabled tool has it); an
    ``input_json`` that is not strict JSON. An absent ``input_json`` is ``None``. The call's ids
    are checked separately (:mod:`codemode.protocol.grpc.identifiers`).
    """
    if not call.HasField("tool_name"):
        raise WireConversionError(texts.TOOL_CALL_OMITTED_TOOL_NAME)
    name = tool_name_to_domain(call.tool_name)
    kind = _KIND_TO_DOMAIN.get(int(call.tool_kind))
    if kind is None:
        raise WireConversionError(texts.tool_not_enabled(name.name))
    value: JSON = None
    if call.HasField("input_json"):
        try:
            value = strict_json.loads(call.input_json)
        except strict_json.JSONError as error:
            raise WireConversionError(texts.tool_call_input_not_json(str(error))) from None
    return CodeModeNestedToolCall(
        CellId(call.cell_id), call.runtime_tool_call_id, name, kind, value
    )


# -- requests ---------------------------------------------------------------------------------------


def execute_request_to_proto(
    request: ExecuteRequest, *, session_id: str, execution_id: str
) -> pb.ExecuteRequest:
    """Convert an execute request (client side); ``yield_time_ms`` and ``max_output_tokens``
    must fit a uint64 and are absent when ``None``."""
    proto = pb.ExecuteRequest(
        session_id=session_id,
        execution_id=execution_id,
        tool_call_id=request.tool_call_id,
        source=request.source,
        enabled_tools=[tool_definition_to_proto(tool) for tool in request.enabled_tools],
    )
    yield_time_ms = _optional_u64(request.yield_time_ms)
    if yield_time_ms is not None:
        proto.yield_time_ms = yield_time_ms
    max_output_tokens = _optional_u64(request.max_output_tokens)
    if max_output_tokens is not None:
        proto.max_output_tokens = max_output_tokens
    return proto


def execute_request_to_domain(request: pb.ExecuteRequest) -> ExecuteRequest:
    """Convert an execute request (host side): ``tool_call_id`` is checked (§3), then every tool
    definition. ``max_output_tokens``, a uint64 here but an i32 in the domain, saturates at the
    i32's maximum (upstream 0.171.0 accepts any uint64; no output is that long).
    ``session_id`` and ``execution_id`` are the caller's to check, first."""
    tool_call_id = check_request_identifier("tool_call_id", request.tool_call_id)
    enabled_tools = [tool_definition_to_domain(tool) for tool in request.enabled_tools]
    max_output_tokens = None
    if request.HasField("max_output_tokens"):
        max_output_tokens = min(request.max_output_tokens, I32_MAX)
    return ExecuteRequest(
        tool_call_id=tool_call_id,
        source=request.source,
        enabled_tools=enabled_tools,
        yield_time_ms=request.yield_time_ms if request.HasField("yield_time_ms") else None,
        max_output_tokens=max_output_tokens,
    )


def wait_request_to_proto(request: WaitRequest, *, session_id: str, wait_id: str) -> pb.WaitRequest:
    """Convert a wait request; ``yield_time_ms`` must fit a uint64."""
    return pb.WaitRequest(
        session_id=session_id,
        cell_id=request.cell_id.value,
        wait_id=wait_id,
        yield_time_ms=_u64(request.yield_time_ms),
    )


def wait_request_to_domain(request: pb.WaitRequest) -> WaitRequest:
    """Convert a wait request (host side); ``cell_id`` is checked (§3). ``session_id`` and
    ``wait_id`` are the caller's to check, first."""
    cell_id = check_request_identifier("cell_id", request.cell_id)
    return WaitRequest(CellId(cell_id), request.yield_time_ms)


# -- session limits ---------------------------------------------------------------------------------


def limits_to_proto(limits: CodeModeSessionCellExecutionLimits) -> pb.SessionCellExecutionLimits:
    """Convert session limits; ``None`` leaves a field absent. A heap size that does not fit a
    uint64 is ``invalid code-mode heap size limit: ⟨detail⟩``."""
    proto = pb.SessionCellExecutionLimits()
    if limits.max_yield_time_ms is not None:
        proto.max_yield_time_ms = _u64(limits.max_yield_time_ms)
    if limits.max_heap_size_bytes is not None:
        try:
            proto.max_heap_size_bytes = _u64(limits.max_heap_size_bytes)
        except WireConversionError as error:
            raise WireConversionError(texts.invalid_heap_size_limit(error.message)) from None
    return proto


def limits_to_domain(limits: pb.SessionCellExecutionLimits) -> CodeModeSessionCellExecutionLimits:
    """Copy session limits (absent is ``None``). Whether the runtime accepts them (a heap size of
    0 is refused) is the runtime's check, with its own text."""
    return CodeModeSessionCellExecutionLimits(
        limits.max_yield_time_ms if limits.HasField("max_yield_time_ms") else None,
        limits.max_heap_size_bytes if limits.HasField("max_heap_size_bytes") else None,
    )


def open_session_request(
    limits: CodeModeSessionCellExecutionLimits | None = None,
) -> pb.OpenSessionRequest:
    """The ``OpenSession`` request: ``cell_execution_limits`` only when a limit is set (§4.1)."""
    if limits is None or limits.is_default:
        return pb.OpenSessionRequest()
    return pb.OpenSessionRequest(cell_execution_limits=limits_to_proto(limits))


# -- tool results (§6.3) ---------------------------------------------------------------------------


def encode_tool_output(value: JSON) -> bytes:
    """A tool's result as ``output_json``; ``failed to encode code-mode tool result: ⟨detail⟩`` if
    it is not JSON (NaN and infinities included)."""
    try:
        return _json_bytes(value)
    except ValueError as error:
        raise WireConversionError(texts.tool_result_not_encodable(str(error))) from None


def truncate_tool_error(message: str) -> str:
    """``message`` if it fits 64 KiB of UTF-8; else its longest prefix that ends on a character
    boundary and leaves room for ``... [truncated]``, plus that suffix (64 KiB at most in all).

    A lone surrogate, which UTF-8 cannot carry, becomes U+FFFD first.
    """
    message = well_formed(message)
    data = message.encode("utf-8")
    if len(data) <= MAX_TOOL_ERROR_MESSAGE_BYTES:
        return message
    budget = MAX_TOOL_ERROR_MESSAGE_BYTES - len(_TRUNCATED_SUFFIX_BYTES)
    # Valid UTF-8 cut anywhere is invalid only at its end: "ignore" drops that partial character.
    return data[:budget].decode("utf-8", "ignore") + texts.TRUNCATED_SUFFIX


def tool_call_succeeded(
    session_id: str, invocation_id: str, output_json: bytes
) -> pb.CompleteToolCallRequest:
    """A ``CompleteToolCall`` request carrying a result (``output_json`` as given)."""
    return pb.CompleteToolCallRequest(
        session_id=session_id,
        invocation_id=invocation_id,
        succeeded=pb.ToolCallSucceeded(output_json=output_json),
    )


def tool_call_failed(
    session_id: str, invocation_id: str, message: str
) -> pb.CompleteToolCallRequest:
    """A ``CompleteToolCall`` request carrying a failure (``message`` cut to 64 KiB)."""
    return pb.CompleteToolCallRequest(
        session_id=session_id,
        invocation_id=invocation_id,
        failed=pb.ToolCallFailed(message=truncate_tool_error(message)),
    )


def fit_message_limit(
    request: pb.CompleteToolCallRequest, limit: int = MAX_MESSAGE_BYTES
) -> pb.CompleteToolCallRequest:
    """``request`` if its encoding is at most ``limit`` bytes (64 MiB), else the failure
    ``code-mode tool result of ⟨N⟩ encoded bytes exceeds the gRPC message limit of ⟨M⟩ bytes``
    for the same invocation (N counts the whole request, envelope included)."""
    size = request.ByteSize()
    if size <= limit:
        return request
    return tool_call_failed(
        request.session_id, request.invocation_id, texts.tool_result_too_large(size, limit)
    )


def complete_tool_call_request(
    session_id: str,
    invocation_id: str,
    result: ToolReturned | CallbackFailed,
    *,
    limit: int = MAX_MESSAGE_BYTES,
) -> pb.CompleteToolCallRequest:
    """The ``CompleteToolCall`` request that answers an invocation with a delegate's result, as
    §6.3 has it: a value as ``output_json`` (one that is not JSON becomes the failure ``failed to
    encode code-mode tool result: ⟨detail⟩``), a failure's message cut to 64 KiB, and a request
    over ``limit`` replaced by the oversize failure."""
    if isinstance(result, ToolReturned):
        try:
            request = tool_call_succeeded(
                session_id, invocation_id, encode_tool_output(result.value)
            )
        except WireConversionError as error:
            request = tool_call_failed(session_id, invocation_id, error.message)
    else:
        request = tool_call_failed(session_id, invocation_id, result.message)
    return fit_message_limit(request, limit)
