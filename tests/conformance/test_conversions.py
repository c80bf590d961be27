"""``conversions.json``: domain ⇄ wire conversions and their range errors."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from codemode.errors import WireConversionError
from codemode.protocol import (
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    ToolDefinition,
    ToolName,
)
from codemode.protocol.v1 import encode_payload
from codemode.protocol.v1.conversions import (
    execute_request_to_domain,
    execute_request_to_wire,
    limits_to_domain,
    limits_to_wire,
)
from codemode.protocol.v1.messages import WireExecuteRequest, WireSessionCellExecutionLimits
from tests.conformance.vectors import params


def execute_from_json(value: dict[str, Any]) -> ExecuteRequest:
    tools = [
        ToolDefinition(
            name=tool["name"],
            tool_name=ToolName(tool["tool_name"]["name"], tool["tool_name"]["namespace"]),
            description=tool["description"],
            kind=CodeModeToolKind(tool["kind"]),
            input_schema=tool["input_schema"],
            output_schema=tool["output_schema"],
        )
        for tool in value["enabled_tools"]
    ]
    return ExecuteRequest(
        tool_call_id=value["tool_call_id"],
        enabled_tools=tools,
        source=value["source"],
        yield_time_ms=value["yield_time_ms"],
        max_output_tokens=value["max_output_tokens"],
    )


def execute_to_json(request: ExecuteRequest) -> dict[str, Any]:
    return {
        "tool_call_id": request.tool_call_id,
        "enabled_tools": [
            {
                "name": tool.name,
                "tool_name": {"name": tool.tool_name.name, "namespace": tool.tool_name.namespace},
                "description": tool.description,
                "kind": tool.kind.value,
                "input_schema": tool.input_schema,
                "output_schema": tool.output_schema,
            }
            for tool in request.enabled_tools
        ],
        "source": request.source,
        "yield_time_ms": request.yield_time_ms,
        "max_output_tokens": request.max_output_tokens,
    }


def convert(entry: dict[str, Any]) -> Any:
    kind, direction, value = entry["type"], entry["direction"], entry["input"]
    if kind == "ExecuteRequest" and direction == "to_wire":
        return json.loads(encode_payload(execute_request_to_wire(execute_from_json(value))))
    if kind == "ExecuteRequest":
        wire = msgspec.convert(value, WireExecuteRequest)
        return execute_to_json(execute_request_to_domain(wire))
    if direction == "to_wire":
        limits = CodeModeSessionCellExecutionLimits(**value)
        return json.loads(encode_payload(limits_to_wire(limits)))
    domain = limits_to_domain(msgspec.convert(value, WireSessionCellExecutionLimits))
    return {
        "max_yield_time_ms": domain.max_yield_time_ms,
        "max_heap_size_bytes": domain.max_heap_size_bytes,
    }


@pytest.mark.parametrize("entry", params("conversions.json"))
def test_conversion(entry: dict[str, Any]) -> None:
    if "expect" in entry:
        assert convert(entry) == entry["expect"]
    else:
        with pytest.raises(WireConversionError) as caught:
            convert(entry)
        assert str(caught.value) == entry["expect_error"]
        assert isinstance(caught.value, ValueError)
