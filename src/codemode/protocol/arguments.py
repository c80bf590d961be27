"""The one up-front check of session API arguments, shared by every carrier.

The embedded session, the V1 clients and the gRPC client call these before anything is run or
sent, so a bad argument fails the same way everywhere and the session stays usable:

* an integer field (``yield_time_ms``, ``max_output_tokens``, a limit) that is not an ``int`` in
  its wire range: :class:`WireConversionError` X1 (``protocol-v1.md`` §5; ``bool`` is no integer);
* a field of the wrong Python type: :class:`ArgumentTypeError` ``WHAT must be TYPE, not GOT``;
* a string with a lone surrogate (UTF-8 cannot carry it): :class:`WireConversionError`
  ``WHAT contains a lone surrogate (U+XXXX at index N)``;
* a tool schema that is not JSON: :class:`WireConversionError` ``failed to encode code-mode tool
  input schema: DETAIL`` (``output`` for the output schema; the gRPC texts);
* ``max_heap_size_bytes = 0``: :class:`InvalidLimitsError` (``runtime.md`` §13.10).
"""

from __future__ import annotations

import re
from typing import Any, Final

from codemode.errors import ArgumentTypeError, CodeModeError, WireConversionError
from codemode.protocol import strict_json
from codemode.protocol.constants import I32_MAX, U64_MAX
from codemode.protocol.grpc import texts as grpc_texts
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    ToolDefinition,
    ToolName,
    WaitRequest,
)

__all__ = [
    "InvalidLimitsError",
    "check_cell_id",
    "check_execute_request",
    "check_limits",
    "check_wait_request",
]

_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_KINDS: Final = frozenset(kind.value for kind in CodeModeToolKind)


class InvalidLimitsError(CodeModeError):
    """The runtime cannot enforce the requested session limits; ``detail`` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"invalid code-mode session execution limits: {detail}")
        self.detail = detail


def _type_error(what: str, expected: str, value: object) -> ArgumentTypeError:
    return ArgumentTypeError(f"{what} must be {expected}, not {type(value).__name__}")


def _string(what: str, value: object) -> None:
    if not isinstance(value, str):
        raise _type_error(what, "a str", value)
    if not value.isascii() and (found := _SURROGATE.search(value)) is not None:
        raise WireConversionError(
            f"{what} contains a lone surrogate (U+{ord(found.group()):04X} at index "
            f"{found.start()})"
        )


def _integer(value: object, high: int) -> None:
    if type(value) is not int or not 0 <= value <= high:
        raise WireConversionError()


def _optional_integer(value: object, high: int) -> None:
    if value is not None:
        _integer(value, high)


def check_cell_id(cell_id: object, what: str = "cell_id") -> None:
    """``cell_id`` must be a :class:`CellId` (any string value, ``""`` included)."""
    if not isinstance(cell_id, CellId):
        raise _type_error(what, "a CellId", cell_id)
    _string(what, cell_id.value)


def _schema(tool: str, value: Any, field: str) -> None:
    if value is None:
        return
    try:
        encoded = strict_json.dumps(value)
    except (TypeError, ValueError, OverflowError) as error:
        detail = str(error)
    else:
        number = strict_json.non_finite_number(value) if b"null" in encoded else None
        if number is None:
            return
        detail = f"{number} is not a JSON number"
    if field == "input":
        raise WireConversionError(grpc_texts.tool_input_schema_not_encodable(detail))
    raise WireConversionError(grpc_texts.tool_output_schema_not_encodable(detail))


def _tool(tool: object, what: str) -> None:
    if not isinstance(tool, ToolDefinition):
        raise _type_error(what, "a ToolDefinition", tool)
    _string(f"{what}.name", tool.name)
    name = tool.tool_name
    if not isinstance(name, ToolName):
        raise _type_error(f"{what}.tool_name", "a ToolName", name)
    _string(f"{what}.tool_name.name", name.name)
    if name.namespace is not None:
        _string(f"{what}.tool_name.namespace", name.namespace)
    _string(f"{what}.description", tool.description)
    if not isinstance(tool.kind, str) or tool.kind not in _KINDS:
        raise ArgumentTypeError(f"{what}.kind must be a CodeModeToolKind, not {tool.kind!r}")
    _schema(tool.name, tool.input_schema, "input")
    _schema(tool.name, tool.output_schema, "output")


def check_execute_request(request: object) -> None:
    """Refuse an execute request no carrier could run as given (see the module docstring)."""
    if not isinstance(request, ExecuteRequest):
        raise _type_error("execute()'s request", "an ExecuteRequest", request)
    _string("ExecuteRequest.tool_call_id", request.tool_call_id)
    _string("ExecuteRequest.source", request.source)
    tools = request.enabled_tools
    if not isinstance(tools, list | tuple):
        raise _type_error("ExecuteRequest.enabled_tools", "a list of ToolDefinition", tools)
    for index, tool in enumerate(tools):
        _tool(tool, f"ExecuteRequest.enabled_tools[{index}]")
    _optional_integer(request.yield_time_ms, U64_MAX)
    _optional_integer(request.max_output_tokens, I32_MAX)


def check_wait_request(request: object) -> None:
    """Refuse a wait request whose cell id is no :class:`CellId` or whose yield time is no u64."""
    if not isinstance(request, WaitRequest):
        raise _type_error("wait()'s request", "a WaitRequest", request)
    check_cell_id(request.cell_id, "WaitRequest.cell_id")
    _integer(request.yield_time_ms, U64_MAX)


def check_limits(limits: object) -> None:
    """Refuse session limits that do not fit a u64, or a heap limit of 0 (§13.10)."""
    if not isinstance(limits, CodeModeSessionCellExecutionLimits):
        raise _type_error("limits", "a CodeModeSessionCellExecutionLimits", limits)
    _optional_integer(limits.max_yield_time_ms, U64_MAX)
    _optional_integer(limits.max_heap_size_bytes, U64_MAX)
    if limits.max_heap_size_bytes == 0:
        raise InvalidLimitsError("max_heap_size_bytes must be greater than 0")
