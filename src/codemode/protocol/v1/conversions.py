"""Domain ⇄ V1 wire conversions (``protocol-v1.md`` §5): field by field, never truncating.

An integer that does not fit its target raises :class:`WireConversionError` with the exact text
``out of range integral type conversion attempted``.
"""

from __future__ import annotations

from typing import Final

from codemode.errors import WireConversionError
from codemode.protocol.constants import I32_MAX, U64_MAX
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
from codemode.protocol.v1.messages import (
    UNSET,
    WireContentItem,
    WireExecuteRequest,
    WireInputAudio,
    WireInputImage,
    WireInputText,
    WireNestedToolCall,
    WireResultBody,
    WireRuntimeResponse,
    WireSessionCellExecutionLimits,
    WireTerminated,
    WireToolDefinition,
    WireToolName,
    WireWaitOutcome,
    WireWaitRequest,
    WireYielded,
)
from codemode.protocol.v1.revision import WireRevision

__all__ = [
    "content_item_to_domain",
    "content_item_to_wire",
    "execute_request_to_domain",
    "execute_request_to_wire",
    "limits_to_domain",
    "limits_to_wire",
    "nested_tool_call_to_domain",
    "nested_tool_call_to_wire",
    "runtime_response_to_domain",
    "runtime_response_to_wire",
    "tool_definition_to_domain",
    "tool_definition_to_wire",
    "wait_outcome_to_domain",
    "wait_outcome_to_wire",
    "wait_request_to_domain",
    "wait_request_to_wire",
]


def _in_range(value: int, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise WireConversionError()
    return value


def _optional_in_range(value: int | None, low: int, high: int) -> int | None:
    return None if value is None else _in_range(value, low, high)


def tool_name_to_wire(name: ToolName) -> WireToolName:
    """Copy a tool name."""
    return WireToolName(name.name, name.namespace)


def tool_definition_to_wire(tool: ToolDefinition) -> WireToolDefinition:
    """Copy a tool definition."""
    return WireToolDefinition(
        tool.name,
        tool_name_to_wire(tool.tool_name),
        tool.description,
        CodeModeToolKind(tool.kind).value,
        tool.input_schema,
        tool.output_schema,
    )


def tool_definition_to_domain(tool: WireToolDefinition) -> ToolDefinition:
    """Copy a wire tool definition."""
    return ToolDefinition(
        tool.name,
        ToolName(tool.tool_name.name, tool.tool_name.namespace),
        tool.description,
        CodeModeToolKind(tool.kind),
        tool.input_schema,
        tool.output_schema,
    )


def execute_request_to_wire(request: ExecuteRequest) -> WireExecuteRequest:
    """Convert an execute request; ``max_output_tokens`` must fit an i32, ``yield_time_ms`` a u64."""
    return WireExecuteRequest(
        request.tool_call_id,
        [tool_definition_to_wire(tool) for tool in request.enabled_tools],
        request.source,
        _optional_in_range(request.yield_time_ms, 0, U64_MAX),
        _optional_in_range(request.max_output_tokens, 0, I32_MAX),
    )


def execute_request_to_domain(request: WireExecuteRequest) -> ExecuteRequest:
    """Convert a wire execute request; a negative ``max_output_tokens`` is out of range."""
    return ExecuteRequest(
        tool_call_id=request.tool_call_id,
        enabled_tools=[tool_definition_to_domain(tool) for tool in request.enabled_tools],
        source=request.source,
        yield_time_ms=request.yield_time_ms,
        max_output_tokens=_optional_in_range(request.max_output_tokens, 0, I32_MAX),
    )


def wait_request_to_wire(request: WaitRequest) -> WireWaitRequest:
    """Convert a wait request; ``yield_time_ms`` must fit a u64."""
    return WireWaitRequest(request.cell_id.value, _in_range(request.yield_time_ms, 0, U64_MAX))


def wait_request_to_domain(request: WireWaitRequest) -> WaitRequest:
    """Convert a wire wait request."""
    return WaitRequest(CellId(request.cell_id), request.yield_time_ms)


def limits_to_wire(limits: CodeModeSessionCellExecutionLimits) -> WireSessionCellExecutionLimits:
    """Convert session limits; ``None`` omits the key."""
    yield_ms, heap = limits.max_yield_time_ms, limits.max_heap_size_bytes
    return WireSessionCellExecutionLimits(
        UNSET if yield_ms is None else _in_range(yield_ms, 0, U64_MAX),
        UNSET if heap is None else _in_range(heap, 0, U64_MAX),
    )


def limits_to_domain(limits: WireSessionCellExecutionLimits) -> CodeModeSessionCellExecutionLimits:
    """Convert wire session limits (always succeeds: usize is 64-bit here)."""
    yield_ms, heap = limits.max_yield_time_ms, limits.max_heap_size_bytes
    return CodeModeSessionCellExecutionLimits(
        None if yield_ms is UNSET else yield_ms,
        None if heap is UNSET else heap,
    )


def content_item_to_wire(item: ContentItem) -> WireContentItem:
    """Convert a content item."""
    if isinstance(item, InputText):
        return WireInputText(item.text)
    if isinstance(item, InputImage):
        detail = UNSET if item.detail is None else ImageDetail(item.detail).value
        return WireInputImage(item.image_url, detail)  # type: ignore[arg-type]
    return WireInputAudio(item.audio_url)


def content_item_to_domain(item: WireContentItem) -> ContentItem:
    """Convert a wire content item."""
    if isinstance(item, WireInputText):
        return InputText(item.text)
    if isinstance(item, WireInputImage):
        detail = None if item.detail is UNSET else ImageDetail(item.detail)
        return InputImage(item.image_url, detail)
    return InputAudio(item.audio_url)


def runtime_response_to_wire(
    response: RuntimeResponse, revision: WireRevision = WireRevision.PINNED
) -> WireRuntimeResponse:
    """Convert a runtime response to its externally tagged wire form.

    ``pinned`` writes no timing field. ``latest`` writes both of its fields; a timing the
    response does not carry is written as 0, and one that does not fit a u64 is out of range.
    """
    cell_id = response.cell_id.value
    items = [content_item_to_wire(item) for item in response.content_items]
    latest = revision is WireRevision.LATEST
    duration = _timing(response.host_duration_ns) if latest else UNSET
    if isinstance(response, Result):
        buffered = _timing(response.result_buffered_for_ns) if latest else UNSET
        body = WireResultBody(cell_id, items, response.error_text, buffered, duration)
        return WireRuntimeResponse(result=body)
    if isinstance(response, Yielded):
        return WireRuntimeResponse(yielded=WireYielded(cell_id, items, duration))
    return WireRuntimeResponse(terminated=WireTerminated(cell_id, items, duration))


def _timing(value: int | None) -> int:
    return 0 if value is None else _in_range(value, 0, U64_MAX)


def runtime_response_to_domain(response: WireRuntimeResponse) -> RuntimeResponse:
    """Convert a wire runtime response (timing fields, when present, are kept)."""
    body = response.body
    cell_id = CellId(body.cell_id)
    items = [content_item_to_domain(item) for item in body.content_items]
    duration = None if body.code_mode_host_duration_ns is UNSET else body.code_mode_host_duration_ns
    if isinstance(body, WireResultBody):
        buffered = None if body.result_buffered_for_ns is UNSET else body.result_buffered_for_ns
        return Result(
            cell_id,
            items,
            body.error_text,
            host_duration_ns=duration,
            result_buffered_for_ns=buffered,
        )
    if isinstance(body, WireYielded):
        return Yielded(cell_id, items, host_duration_ns=duration)
    return Terminated(cell_id, items, host_duration_ns=duration)


def wait_outcome_to_wire(
    outcome: WaitOutcome, revision: WireRevision = WireRevision.PINNED
) -> WireWaitOutcome:
    """Convert a wait outcome (its response in ``revision``'s shape)."""
    response = runtime_response_to_wire(outcome.response, revision)
    if isinstance(outcome, LiveCell):
        return WireWaitOutcome(live_cell=response)
    return WireWaitOutcome(missing_cell=response)


def wait_outcome_to_domain(outcome: WireWaitOutcome) -> WaitOutcome:
    """Convert a wire wait outcome."""
    if outcome.live_cell is not UNSET:
        return LiveCell(runtime_response_to_domain(outcome.live_cell))
    return MissingCell(runtime_response_to_domain(outcome.response))


def nested_tool_call_to_wire(call: CodeModeNestedToolCall) -> WireNestedToolCall:
    """Convert a nested tool call (``None`` input is ``null``)."""
    return WireNestedToolCall(
        call.cell_id.value,
        call.runtime_tool_call_id,
        tool_name_to_wire(call.tool_name),
        _tool_kind(call.tool_kind).value,
        call.input,
    )


def nested_tool_call_to_domain(call: WireNestedToolCall) -> CodeModeNestedToolCall:
    """Convert a wire nested tool call."""
    return CodeModeNestedToolCall(
        CellId(call.cell_id),
        call.runtime_tool_call_id,
        ToolName(call.tool_name.name, call.tool_name.namespace),
        _tool_kind(call.tool_kind),
        call.input,
    )


# Per nested call: a dict lookup instead of the enum's constructor (several times slower).
_TOOL_KINDS: Final[dict[str, CodeModeToolKind]] = {kind.value: kind for kind in CodeModeToolKind}


def _tool_kind(value: str) -> CodeModeToolKind:
    kind = _TOOL_KINDS.get(value)
    return CodeModeToolKind(value) if kind is None else kind  # the enum's own error if unknown
