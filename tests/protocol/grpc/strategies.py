"""Hypothesis strategies for the domain values the gRPC conversions carry."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from codemode.protocol.constants import I32_MAX
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    Terminated,
    ToolDefinition,
    ToolName,
    WaitRequest,
    Yielded,
)
from tests.protocol.v1.strategies import json_values, text, u64

#: Identifiers within the 256-byte bound (at most 64 characters of up to 4 bytes).
identifiers = st.text(min_size=1, max_size=64)
cell_ids = identifiers.map(CellId)
content_items = st.one_of(
    st.builds(InputText, text),
    st.builds(InputImage, text, st.none() | st.sampled_from(ImageDetail)),
    st.builds(InputAudio, text),
)
items = st.lists(content_items, max_size=4)
runtime_responses = st.one_of(
    st.builds(lambda c, i, d: Yielded(c, i, host_duration_ns=d), cell_ids, items, u64),
    st.builds(lambda c, i, d: Terminated(c, i, host_duration_ns=d), cell_ids, items, u64),
    st.builds(
        lambda c, i, e, d: Result(c, i, e, host_duration_ns=d),
        cell_ids,
        items,
        st.none() | text,
        u64,
    ),
)
wait_outcomes = st.one_of(runtime_responses.map(LiveCell), runtime_responses.map(MissingCell))
tool_names = st.builds(ToolName, text, st.none() | text)
kinds = st.sampled_from(CodeModeToolKind)
#: Tool definitions a host accepts: names non-empty and at most 256 bytes (upstream's checks).
host_tool_definitions = st.builds(
    ToolDefinition,
    identifiers,
    st.builds(ToolName, identifiers, st.none() | st.text(max_size=64)),
    text,
    kinds,
    json_values,
    json_values,
)
execute_requests = st.builds(
    ExecuteRequest,
    tool_call_id=identifiers,
    source=text,
    enabled_tools=st.lists(host_tool_definitions, max_size=3),
    yield_time_ms=st.none() | u64,
    max_output_tokens=st.none() | st.integers(0, I32_MAX),  # an i32 in the domain
)
wait_requests = st.builds(WaitRequest, cell_ids, u64)
limits = st.builds(CodeModeSessionCellExecutionLimits, st.none() | u64, st.none() | u64)
nested_calls: st.SearchStrategy[Any] = st.builds(
    CodeModeNestedToolCall, cell_ids, text, tool_names, kinds, json_values
)
