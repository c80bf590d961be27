"""Hypothesis strategies for V1 wire messages."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from codemode.protocol.v1 import messages as m
from codemode.protocol.whitespace import WHITE_SPACE

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
text = st.text(max_size=20)
non_blank = st.text(min_size=1, max_size=12).filter(lambda s: s.strip(WHITE_SPACE) != "")
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
capabilities = st.lists(non_blank, max_size=4, unique=True).map(tuple)
versions = st.lists(
    st.integers(min_value=1, max_value=2**32 - 1), min_size=1, max_size=4, unique=True
).map(tuple)
content_items = st.one_of(
    st.builds(m.WireInputText, text),
    st.builds(
        m.WireInputImage,
        text,
        st.sampled_from([m.UNSET, "auto", "low", "high", "original"]),
    ),
    st.builds(m.WireInputAudio, text),
)
items = st.lists(content_items, max_size=3)
runtime_responses = st.one_of(
    st.builds(lambda c, i: m.WireRuntimeResponse(yielded=m.WireYielded(c, i)), text, items),
    st.builds(lambda c, i: m.WireRuntimeResponse(terminated=m.WireTerminated(c, i)), text, items),
    st.builds(
        lambda c, i, e: m.WireRuntimeResponse(result=m.WireResultBody(c, i, e)),
        text,
        items,
        st.none() | text,
    ),
)
outcomes = st.one_of(
    runtime_responses.map(lambda r: m.WireWaitOutcome(live_cell=r)),
    runtime_responses.map(lambda r: m.WireWaitOutcome(missing_cell=r)),
)
tool_names = st.builds(m.WireToolName, text, st.none() | text)
kinds = st.sampled_from(["function", "freeform"])
tool_definitions = st.builds(
    m.WireToolDefinition, text, tool_names, text, kinds, json_values, json_values
)
execute_requests = st.builds(
    m.WireExecuteRequest,
    text,
    st.lists(tool_definitions, max_size=3),
    text,
    st.none() | u64,
    st.none() | st.integers(min_value=-(2**31), max_value=2**31 - 1),
)
limits = st.builds(m.WireSessionCellExecutionLimits, st.just(m.UNSET) | u64, st.just(m.UNSET) | u64)
host_requests = st.one_of(
    st.builds(m.SessionOpen, non_blank, st.just(m.UNSET) | limits),
    st.builds(m.SessionExecute, non_blank, execute_requests),
    st.builds(m.SessionWait, non_blank, st.builds(m.WireWaitRequest, text, u64)),
    st.builds(m.SessionTerminate, non_blank, text),
    st.builds(m.SessionShutdown, non_blank),
)
host_responses = st.one_of(
    st.builds(m.SessionReady, non_blank),
    st.builds(m.ExecutionStarted, text),
    st.builds(m.WaitCompleted, outcomes),
    st.builds(m.SessionClosed, non_blank),
)
nested_calls = st.builds(m.WireNestedToolCall, text, text, tool_names, kinds, json_values)
errors = st.builds(m.WireError, text)
client_to_host: st.SearchStrategy[Any] = st.one_of(
    st.builds(
        lambda v, caps, n: m.ConnectionHello(v, caps[:n], caps[n:]),
        versions,
        st.lists(non_blank, max_size=6, unique=True).map(tuple),
        st.integers(0, 6),
    ),
    st.builds(m.OperationRequest, i64, host_requests),
    st.builds(m.OperationCancel, i64),
    st.builds(
        m.DelegateResponseMessage,
        i64,
        st.one_of(
            errors,
            st.builds(m.ToolResult, json_values).map(m.WireOk),
            st.just(m.WireOk(m.NotificationDelivered())),
        ),
    ),
)
reject_reasons = st.one_of(
    st.builds(m.NoCompatibleVersion, versions),
    st.builds(m.MissingRequiredCapability, non_blank),
    st.builds(m.InvalidHello, text),
)
host_to_client: st.SearchStrategy[Any] = st.one_of(
    st.builds(
        m.ConnectionReady,
        st.integers(min_value=1, max_value=2**32 - 1),
        capabilities,
        st.just(m.UNSET) | text,
    ),
    st.builds(m.ConnectionRejected, reject_reasons),
    st.builds(m.OperationResponse, i64, errors | host_responses.map(m.WireOk)),
    st.builds(m.ExecuteInitialResponse, i64, errors | runtime_responses.map(m.WireOk)),
    st.builds(
        m.DelegateRequestMessage,
        i64,
        non_blank,
        st.one_of(
            st.builds(m.ToolInvoke, nested_calls),
            st.builds(m.NotificationSend, text, text, text),
        ),
    ),
    st.builds(m.DelegateCancel, i64),
    st.builds(m.CellClosed, non_blank, text),
)
