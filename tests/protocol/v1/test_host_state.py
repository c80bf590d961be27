"""The sans-I/O V1 host state machine (``protocol-v1.md`` §3, §8): every client message, every host
rule and every H/L text. Messages are fed decoded; the actions that come out are compared exactly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from codemode.errors import ProtocolError
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    MAX_PENDING_DELEGATE_CALLS,
    RECENT_ID_MEMORY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    Terminated,
    WaitRequest,
    Yielded,
)
from codemode.protocol.v1.codec import encode_payload
from codemode.protocol.v1.host_state import (
    CANCELLED,
    SESSION_CALLBACK_RESERVE,
    CancelOperation,
    HostAction,
    HostConnection,
    OpenSession,
    ResolveCallback,
    Send,
    StartExecute,
    StartShutdown,
    StartTerminate,
    StartWait,
)
from codemode.protocol.v1.messages import (
    UNSET,
    CellClosed,
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequest,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostRequest,
    HostToClient,
    InvalidHello,
    MissingRequiredCapability,
    NoCompatibleVersion,
    NotificationDelivered,
    NotificationSend,
    OperationCancel,
    OperationRequest,
    OperationResponse,
    SessionClosed,
    SessionExecute,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    SessionTerminate,
    SessionWait,
    ToolInvoke,
    ToolResult,
    UnsetType,
    WaitCompleted,
    WireError,
    WireExecuteRequest,
    WireInputText,
    WireNestedToolCall,
    WireOk,
    WireResultBody,
    WireRuntimeResponse,
    WireSessionCellExecutionLimits,
    WireTerminated,
    WireToolName,
    WireWaitOutcome,
    WireWaitRequest,
    WireYielded,
)

S1 = "session-1"
S2 = "session-2"
LIMITS = SESSION_RESOURCE_LIMITS_CAPABILITY
DUAL = DUAL_WEBSOCKET_CAPABILITY

H1 = "code-mode request cancelled"
H2 = "code-mode host has too many in-flight requests"
H3 = "code-mode host has too many active cells"
H4 = "code-mode host is shutting down"
H9 = (
    "invalid code-mode session execution limits: capability "
    "`session-cell-execution-resource-limits` was not negotiated"
)
X1 = "out of range integral type conversion attempted"


# -- helpers -------------------------------------------------------------------------------------


def hello(*optional: str, required: Sequence[str] = ()) -> ConnectionHello:
    return ConnectionHello((1,), tuple(required), tuple(optional))


def host(*optional: str, **options: Any) -> HostConnection:
    """A host whose handshake succeeded; the client lists ``optional`` (default: limits)."""
    state = HostConnection(**options)
    reply = state.negotiate(hello(*(optional or (LIMITS,))))
    assert isinstance(reply, ConnectionReady)
    return state


def sent(actions: Sequence[HostAction]) -> list[HostToClient]:
    messages = [action.message for action in actions if isinstance(action, Send)]
    assert len(messages) == len(actions), f"unexpected non-send actions in {actions!r}"
    return messages


def request(request_id: int, body: HostRequest) -> OperationRequest:
    return OperationRequest(request_id, body)


def open_(
    request_id: int,
    session: str = S1,
    limits: WireSessionCellExecutionLimits | UnsetType = UNSET,
) -> OperationRequest:
    return request(request_id, SessionOpen(session, limits))


def execute(
    request_id: int, session: str = S1, *, max_output_tokens: int | None = 1000
) -> OperationRequest:
    body = WireExecuteRequest("call-1", [], "text('x')", 5000, max_output_tokens)
    return request(request_id, SessionExecute(session, body))


def wait(request_id: int, cell: str, session: str = S1, yield_ms: int = 100) -> OperationRequest:
    return request(request_id, SessionWait(session, WireWaitRequest(cell, yield_ms)))


def terminate(request_id: int, cell: str, session: str = S1) -> OperationRequest:
    return request(request_id, SessionTerminate(session, cell))


def shutdown(request_id: int, session: str = S1) -> OperationRequest:
    return request(request_id, SessionShutdown(session))


def refused(request_id: int, message: str) -> list[HostToClient]:
    return [OperationResponse(request_id, WireError(message))]


def ok(request_id: int, value: Any) -> OperationResponse:
    return OperationResponse(request_id, WireOk(value))


def started(request_id: int, cell: str) -> OperationResponse:
    return ok(request_id, ExecutionStarted(cell))


def result(cell: str, text: str = "done") -> Result:
    return Result(CellId(cell), [InputText(text)], None)


def wire_result(cell: str, text: str = "done") -> WireRuntimeResponse:
    return WireRuntimeResponse(result=WireResultBody(cell, [WireInputText(text)], None))


def initial(request_id: int, cell: str, text: str = "done") -> ExecuteInitialResponse:
    return ExecuteInitialResponse(request_id, WireOk(wire_result(cell, text)))


def cell_closed(cell: str, session: str = S1) -> CellClosed:
    return CellClosed(session, cell)


def tool(cell: str, name: str = "echo") -> ToolInvoke:
    return ToolInvoke(
        WireNestedToolCall(cell, "tool-1", WireToolName(name, None), "function", {"v": 1})
    )


def note(cell: str, text: str = "hi") -> NotificationSend:
    return NotificationSend("call-1", cell, text)


def answer(delegate_id: int, value: Any = None) -> DelegateResponseMessage:
    return DelegateResponseMessage(delegate_id, WireOk(ToolResult(value)))


def opened(state: HostConnection, request_id: int = 1, session: str = S1) -> None:
    """Open ``session`` with request ``request_id`` and report success."""
    assert state.receive(open_(request_id, session)) == [
        OpenSession(request_id, session, CodeModeSessionCellExecutionLimits())
    ]
    assert sent(state.session_opened(request_id)) == [ok(request_id, SessionReady(session))]


def admitted(state: HostConnection, request_id: int, cell: str, session: str = S1) -> None:
    """Execute in ``session`` with request ``request_id``; the runtime admits ``cell``."""
    actions = state.receive(execute(request_id, session))
    assert len(actions) == 1 and isinstance(actions[0], StartExecute)
    sends = state.execution_started(request_id, CellId(cell))
    assert sends is not None
    assert sent(sends) == [started(request_id, cell)]


def finished_cell(state: HostConnection, request_id: int, cell: str, session: str = S1) -> None:
    """An admitted cell that already delivered its initial response (a running, yielded cell)."""
    admitted(state, request_id, cell, session)
    response = Yielded(CellId(cell), [])
    assert sent(state.initial_response(request_id, response)) == [
        ExecuteInitialResponse(
            request_id, WireOk(WireRuntimeResponse(yielded=WireYielded(cell, [])))
        )
    ]


def start_callback(
    state: HostConnection, cell: str, body: DelegateRequest | None = None, session: str = S1
) -> tuple[int | None, list[HostToClient]]:
    delegate_id, sends = state.start_callback(session, CellId(cell), body or tool(cell))
    return delegate_id, sent(sends)


# -- handshake (§3.3) ------------------------------------------------------------------------------


def test_ready_grants_limits_and_matches_the_example_bytes() -> None:
    state = HostConnection()
    reply = state.negotiate(hello(LIMITS))
    assert reply == ConnectionReady(1, (LIMITS,))
    assert encode_payload(reply) == (
        b'{"type":"connection/ready","selectedVersion":1,'
        b'"capabilities":["session-cell-execution-resource-limits"]}'
    )
    assert state.negotiated is not None
    assert state.negotiated.resource_limits
    assert state.negotiated.bulk_connection_token is None


def test_ready_grants_only_what_both_sides_know() -> None:
    state = HostConnection()
    reply = state.negotiate(hello("zz-unknown", DUAL, LIMITS))
    # dual-websocket-v1 is not a capability of this (stdio) host; unknown optional ones are ignored.
    assert reply == ConnectionReady(1, (LIMITS,))


def test_ready_without_capabilities() -> None:
    state = HostConnection()
    reply = state.negotiate(ConnectionHello((1,), (), ()))
    assert reply == ConnectionReady(1, ())
    assert state.negotiated is not None
    assert not state.negotiated.resource_limits


def test_bulk_token_only_with_dual() -> None:
    tokens: list[str] = []

    def new_token() -> str:
        tokens.append(f"tok-{len(tokens)}")
        return tokens[-1]

    dual_host = HostConnection(capabilities=(LIMITS, DUAL), new_token=new_token)
    reply = dual_host.negotiate(hello(DUAL, LIMITS))
    assert reply == ConnectionReady(1, (DUAL, LIMITS), "tok-0")
    assert dual_host.negotiated is not None
    assert dual_host.negotiated.dual_websocket
    assert dual_host.negotiated.bulk_connection_token == "tok-0"

    single = HostConnection(capabilities=(LIMITS, DUAL), new_token=new_token)
    reply = single.negotiate(hello(LIMITS))
    assert reply == ConnectionReady(1, (LIMITS,))
    assert isinstance(reply, ConnectionReady) and reply.bulk_connection_token is UNSET
    assert tokens == ["tok-0"]  # no token was minted for the single connection


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (OperationCancel(1), InvalidHello("first message must be connection/hello")),
        (open_(1), InvalidHello("first message must be connection/hello")),
        (
            DelegateResponseMessage(1, WireOk(NotificationDelivered())),
            InvalidHello("first message must be connection/hello"),
        ),
        (ConnectionHello((2, 3), (), ()), NoCompatibleVersion((1,))),
        (ConnectionHello((2,), ("nope",), ()), NoCompatibleVersion((1,))),
        (hello(required=("zeta", "alpha")), MissingRequiredCapability("alpha")),
        (hello(required=(DUAL,)), MissingRequiredCapability(DUAL)),
    ],
)
def test_rejections(first: ClientToHost, reason: Any) -> None:
    state = HostConnection()
    assert state.negotiate(first) == ConnectionRejected(reason)
    assert state.negotiated is None


def test_invalid_hello_bytes() -> None:
    reply = HostConnection().negotiate(OperationCancel(1))
    assert encode_payload(reply) == (
        b'{"type":"connection/rejected","reason":{"type":"invalidHello",'
        b'"message":"first message must be connection/hello"}}'
    )


def test_required_limits_are_granted() -> None:
    reply = HostConnection().negotiate(hello(required=(LIMITS,)))
    assert reply == ConnectionReady(1, (LIMITS,))


def test_second_hello_is_l3() -> None:
    state = host()
    with pytest.raises(ProtocolError) as caught:
        state.receive(hello(LIMITS))
    assert caught.value.message == "received a second code-mode client hello"


# -- request ids (§8.1) --------------------------------------------------------------------------


def test_duplicate_in_flight_request_id_is_l4() -> None:
    state = host()
    state.receive(open_(7))
    with pytest.raises(ProtocolError) as caught:
        state.receive(open_(7, S2))
    assert caught.value.message == "duplicate code-mode request ID 7"


@pytest.mark.parametrize("request_id", [0, -5, 2**63 - 1, -(2**63)])
def test_any_i64_is_a_request_id_and_finished_ids_stay_taken(request_id: int) -> None:
    state = host()
    assert state.receive(open_(request_id)) == [
        OpenSession(request_id, S1, CodeModeSessionCellExecutionLimits())
    ]
    assert state.in_flight(request_id)
    state.session_opened(request_id)
    assert not state.in_flight(request_id)
    with pytest.raises(ProtocolError, match=rf"^duplicate code-mode request ID {request_id}$"):
        state.receive(shutdown(request_id))


def test_refused_request_ids_count_as_finished() -> None:
    state = host()
    assert sent(state.receive(shutdown(3, "nope"))) == refused(3, "unknown code-mode session nope")
    with pytest.raises(ProtocolError, match=r"^duplicate code-mode request ID 3$"):
        state.receive(open_(3))


def test_the_last_4096_finished_ids_are_remembered() -> None:
    state = host()
    state.receive(shutdown(1, "x"))  # refused: finished
    for request_id in range(2, RECENT_ID_MEMORY + 1):  # 4095 more finished ids
        state.receive(shutdown(request_id, "x"))
    with pytest.raises(ProtocolError, match=r"^duplicate code-mode request ID 1$"):
        state.receive(open_(1))
    # One more finished id pushes id 1 out of the memory: it is accepted again.
    state = host()
    for request_id in range(1, RECENT_ID_MEMORY + 2):
        state.receive(shutdown(request_id, "x"))
    assert state.receive(open_(1)) == [OpenSession(1, S1, CodeModeSessionCellExecutionLimits())]
    with pytest.raises(ProtocolError, match=r"^duplicate code-mode request ID 2$"):
        state.receive(open_(2, S2))


# -- H2: in-flight requests ----------------------------------------------------------------------


def test_too_many_in_flight_requests_is_h2_and_the_id_counts_as_finished() -> None:
    state = host(max_in_flight_requests=2)
    state.receive(open_(1))
    state.receive(open_(2, S2))
    assert sent(state.receive(open_(3, "session-3"))) == refused(3, H2)
    # H2 comes before every method check (here: an unknown session).
    assert sent(state.receive(shutdown(4, "unknown"))) == refused(4, H2)
    with pytest.raises(ProtocolError, match=r"^duplicate code-mode request ID 3$"):
        state.receive(open_(3, "session-3"))
    # Capacity returns when a request finishes; the refused session id was never opened.
    state.session_opened(1)
    assert state.receive(open_(5, "session-3")) == [
        OpenSession(5, "session-3", CodeModeSessionCellExecutionLimits())
    ]


def test_duplicate_id_is_checked_before_h2() -> None:
    state = host(max_in_flight_requests=1)
    state.receive(open_(1))
    with pytest.raises(ProtocolError, match=r"^duplicate code-mode request ID 1$"):
        state.receive(open_(1))


def test_an_admitted_execute_is_in_flight_until_its_initial_response() -> None:
    state = host(max_in_flight_requests=2)
    opened(state)
    admitted(state, 2, "1")
    admitted(state, 3, "2")
    assert sent(state.receive(wait(4, "1"))) == refused(4, H2)
    state.initial_response(2, result("1"))
    assert not state.in_flight(2)
    assert state.receive(wait(5, "2")) == [StartWait(5, S1, WaitRequest(CellId("2"), 100))]


# -- H3: active cells ----------------------------------------------------------------------------


def test_too_many_active_cells_is_h3_counting_pending_admissions() -> None:
    state = host(max_active_cells=1)
    opened(state)
    assert state.receive(execute(2)) == [
        StartExecute(2, S1, ExecuteRequest("call-1", "text('x')", [], 5000, 1000))
    ]
    # The pending admission takes the only slot.
    assert sent(state.receive(execute(3))) == refused(3, H3)
    state.execution_started(2, CellId("1"))
    assert state.active_cells == 1
    assert sent(state.receive(execute(4))) == refused(4, H3)
    # The runtime retires the cell, but cell/closed waits for the initial response: still active.
    assert state.cell_closed(S1, CellId("1")) == []
    assert state.active_cells == 1
    assert sent(state.receive(execute(5))) == refused(5, H3)
    assert sent(state.initial_response(2, result("1"))) == [initial(2, "1"), cell_closed("1")]
    assert state.active_cells == 0
    assert isinstance(state.receive(execute(6))[0], StartExecute)


def test_a_failed_or_cancelled_admission_frees_its_slot() -> None:
    state = host(max_active_cells=1)
    opened(state)
    state.receive(execute(2))
    assert sent(state.operation_failed(2, "code mode session is shutting down")) == refused(
        2, "code mode session is shutting down"
    )
    state.receive(execute(3))
    assert state.receive(OperationCancel(3)) == [CancelOperation(3)]
    assert state.execution_started(3, CellId("1")) is None
    assert sent(state.operation_failed(3, CANCELLED)) == refused(3, H1)
    assert state.active_cells == 0
    assert isinstance(state.receive(execute(4))[0], StartExecute)


def test_cells_of_every_session_count() -> None:
    state = host(max_active_cells=2)
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    assert sent(state.receive(execute(5, S1))) == refused(5, H3)
    assert sent(state.cell_closed(S2, CellId("1"))) == [cell_closed("1", S2)]
    assert isinstance(state.receive(execute(6, S1))[0], StartExecute)


# -- H4: the connection is ending ----------------------------------------------------------------


def test_connection_lost_returns_in_flight_requests_and_callbacks_then_h4() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    admitted(state, 3, "2")
    state.receive(wait(4, "1"))
    state.receive(open_(5, S2))
    first, _ = start_callback(state, "1")
    second, _ = start_callback(state, "2", note("2"))
    requests, callbacks = state.connection_lost()
    assert requests == [3, 4, 5]
    assert callbacks == [first, second]
    assert state.pending_callbacks == 0
    assert sent(state.receive(open_(6, "session-3"))) == refused(6, H4)
    assert sent(state.receive(shutdown(7))) == refused(7, H4)
    # Reports that arrive after the end answer nothing.
    assert state.session_opened(5) == []
    assert state.wait_completed(4, LiveCell(Yielded(CellId("1"), []))) == []
    assert state.initial_response(3, result("2")) == []
    assert state.operation_failed(3, "late") == []


def test_an_execute_admitted_after_the_end_is_abandoned() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.connection_lost()
    assert state.execution_started(2, CellId("1")) is None


def test_h2_is_checked_before_h4() -> None:
    state = host(max_in_flight_requests=1)
    state.receive(open_(1))
    state.connection_lost()
    # connection_lost forgets every in-flight request: the next one sees the closing flag.
    assert sent(state.receive(open_(2, S2))) == refused(2, H4)


# -- H5: unknown sessions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        execute,
        lambda rid, sid: wait(rid, "1", sid),
        lambda rid, sid: terminate(rid, "1", sid),
        shutdown,
    ],
    ids=["execute", "wait", "terminate", "shutdown"],
)
def test_unknown_session_is_h5(make: Any) -> None:
    state = host()
    opened(state)
    assert sent(state.receive(make(2, " odd id "))) == refused(
        2, "unknown code-mode session  odd id "
    )
    # Once shutdown began, the session is unknown to new requests.
    assert state.receive(shutdown(3)) == [StartShutdown(3, S1)]
    assert sent(state.receive(make(4, S1))) == refused(4, "unknown code-mode session session-1")
    # And after it finished.
    assert sent(state.session_shut_down(3)) == [ok(3, SessionClosed(S1))]
    assert sent(state.receive(make(5, S1))) == refused(5, "unknown code-mode session session-1")


def test_an_operation_behind_a_failed_open_is_answered() -> None:
    state = host()
    state.receive(open_(1))
    # Pipelined behind the open: accepted (the glue waits for the open's outcome).
    assert state.receive(execute(2)) == [
        StartExecute(2, S1, ExecuteRequest("call-1", "text('x')", [], 5000, 1000))
    ]
    assert state.receive(shutdown(3)) == [StartShutdown(3, S1)]
    failure = (
        "invalid code-mode session execution limits: max_heap_size_bytes must be greater than 0"
    )
    assert sent(state.operation_failed(1, failure)) == refused(1, failure)
    # The failed open forgets the session.
    assert sent(state.receive(wait(4, "1"))) == refused(4, "unknown code-mode session session-1")
    assert sent(state.operation_failed(2, "unknown code-mode session session-1")) == refused(
        2, "unknown code-mode session session-1"
    )
    # Every request gets exactly one answer: the pipelined shutdown too.
    assert sent(state.session_shut_down(3)) == refused(3, "unknown code-mode session session-1")
    assert not state.in_flight(3)


# -- H6: conversion failures ---------------------------------------------------------------------


def test_negative_max_output_tokens_is_h6() -> None:
    state = host()
    opened(state)
    assert sent(state.receive(execute(2, max_output_tokens=-1))) == refused(
        2, f"invalid code-mode execute request: {X1}"
    )
    assert not state.in_flight(2)
    # Conversion is checked before the session is looked up (§8.2, session/execute).
    assert sent(state.receive(execute(3, "nope", max_output_tokens=-(2**31)))) == refused(
        3, f"invalid code-mode execute request: {X1}"
    )
    # Zero and null are fine.
    assert isinstance(state.receive(execute(4, max_output_tokens=0))[0], StartExecute)
    assert state.receive(execute(5, max_output_tokens=None)) == [
        StartExecute(5, S1, ExecuteRequest("call-1", "text('x')", [], 5000, None))
    ]


# -- session/open: H9, H10, H11 ------------------------------------------------------------------


def test_open_converts_limits() -> None:
    state = host()
    limits = WireSessionCellExecutionLimits(max_yield_time_ms=250)
    assert state.receive(open_(1, S1, limits)) == [
        OpenSession(1, S1, CodeModeSessionCellExecutionLimits(250, None))
    ]
    assert state.receive(open_(2, S2, WireSessionCellExecutionLimits())) == [
        OpenSession(2, S2, CodeModeSessionCellExecutionLimits())
    ]
    big = WireSessionCellExecutionLimits(2**64 - 1, 2**64 - 1)
    assert state.receive(open_(3, "s3", big)) == [
        OpenSession(3, "s3", CodeModeSessionCellExecutionLimits(2**64 - 1, 2**64 - 1))
    ]


@pytest.mark.parametrize(
    "limits", [WireSessionCellExecutionLimits(), WireSessionCellExecutionLimits(1, 2)]
)
def test_limits_without_the_capability_are_h9(limits: WireSessionCellExecutionLimits) -> None:
    state = HostConnection()
    state.negotiate(ConnectionHello((1,), (), ()))
    assert sent(state.receive(open_(1, S1, limits))) == refused(1, H9)
    # Nothing was opened: the id is still free, and a plain open works.
    assert state.receive(open_(2)) == [OpenSession(2, S1, CodeModeSessionCellExecutionLimits())]
    # H9 comes before H10.
    assert sent(state.receive(open_(3, S1, limits))) == refused(3, H9)


def test_limits_are_h9_when_the_host_does_not_offer_the_capability() -> None:
    state = HostConnection(capabilities=())
    assert state.negotiate(hello(LIMITS)) == ConnectionReady(1, ())
    assert sent(state.receive(open_(1, S1, WireSessionCellExecutionLimits()))) == refused(1, H9)


def test_open_twice_is_h10() -> None:
    state = host()
    state.receive(open_(1))
    h10 = "code-mode session ID `session-1` is already open"
    assert sent(state.receive(open_(2))) == refused(2, h10)  # the first open is still running
    state.session_opened(1)
    assert sent(state.receive(open_(3))) == refused(3, h10)


def test_reopen_after_shutdown_is_h11() -> None:
    state = host()
    opened(state)
    h11 = "code-mode session ID `session-1` was reused"
    state.receive(shutdown(2))
    # Shutdown began: the session was removed, its id stays remembered.
    assert sent(state.receive(open_(3))) == refused(3, h11)
    state.session_shut_down(2)
    assert sent(state.receive(open_(4))) == refused(4, h11)


def test_the_last_4096_session_ids_are_remembered() -> None:
    state = host()
    opened(state, 1, "s0")
    state.receive(shutdown(2, "s0"))
    state.session_shut_down(2)
    request_id = 3
    for index in range(1, RECENT_ID_MEMORY):  # 4095 more opened ids
        opened(state, request_id, f"s{index}")
        request_id += 1
    assert sent(state.receive(open_(request_id, "s0"))) == refused(
        request_id, "code-mode session ID `s0` was reused"
    )
    opened(state, request_id + 1, f"s{RECENT_ID_MEMORY}")
    assert state.receive(open_(request_id + 2, "s0")) == [
        OpenSession(request_id + 2, "s0", CodeModeSessionCellExecutionLimits())
    ]


def test_a_failed_open_forgets_the_session() -> None:
    state = host()
    state.receive(open_(1))
    assert sent(state.operation_failed(1, "boom")) == refused(1, "boom")
    assert not state.in_flight(1)
    assert sent(state.receive(execute(2))) == refused(2, "unknown code-mode session session-1")
    assert sent(state.receive(shutdown(3))) == refused(3, "unknown code-mode session session-1")


# -- operation/cancel (§8.5) ---------------------------------------------------------------------


def test_cancel_before_admission() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    assert state.receive(OperationCancel(2)) == [CancelOperation(2)]
    assert state.cancelled(2)
    assert state.receive(OperationCancel(2)) == []  # once
    # The runtime admitted it anyway: the glue must abandon the cell.
    assert state.execution_started(2, CellId("1")) is None
    assert sent(state.operation_failed(2, CANCELLED)) == refused(2, H1)
    assert not state.in_flight(2)
    # Late reports for the id are ignored; the abandoned cell is never announced.
    assert state.initial_response(2, result("1")) == []
    assert state.operation_failed(2, CANCELLED) == []
    assert state.cell_closed(S1, CellId("1")) == []
    assert state.active_cells == 0
    state.receive(shutdown(3))
    assert sent(state.session_shut_down(3)) == [ok(3, SessionClosed(S1))]


def test_cancel_of_an_execute_that_fails_to_be_admitted() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.receive(OperationCancel(2))
    # The runtime refused it before the cancel took effect: its error is the one answer.
    assert sent(state.operation_failed(2, "runtime refused")) == refused(2, "runtime refused")
    assert state.operation_failed(2, CANCELLED) == []


def test_cancel_after_admission_is_ignored() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    assert state.receive(OperationCancel(2)) == []
    assert not state.cancelled(2)
    assert sent(state.initial_response(2, result("1"))) == [initial(2, "1")]


def test_cancel_of_a_wait() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    assert state.receive(OperationCancel(3)) == [CancelOperation(3)]
    assert state.receive(OperationCancel(3)) == []
    assert sent(state.operation_failed(3, CANCELLED)) == refused(3, H1)
    # The real outcome arrives late: ignored, the request was answered.
    assert state.wait_completed(3, LiveCell(Yielded(CellId("1"), []))) == []


def test_a_wait_answered_before_its_cancel_took_effect() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.receive(OperationCancel(3))
    outcome = LiveCell(Yielded(CellId("1"), [InputText("late")]))
    body = WireRuntimeResponse(yielded=WireYielded("1", [WireInputText("late")]))
    assert sent(state.wait_completed(3, outcome)) == [
        ok(3, WaitCompleted(WireWaitOutcome(live_cell=body)))
    ]
    assert state.operation_failed(3, CANCELLED) == []


def test_ignored_cancels() -> None:
    state = host()
    state.receive(open_(1))
    assert state.receive(OperationCancel(1)) == []  # open
    state.session_opened(1)
    finished_cell(state, 2, "1")
    assert state.receive(OperationCancel(2)) == []  # finished execute
    state.receive(terminate(3, "1"))
    assert state.receive(OperationCancel(3)) == []  # terminate
    state.receive(shutdown(4))
    assert state.receive(OperationCancel(4)) == []  # shutdown
    assert state.receive(OperationCancel(99)) == []  # never seen
    assert state.receive(OperationCancel(1)) == []  # finished open
    for request_id in (1, 2, 3, 4):
        assert not state.cancelled(request_id)


# -- execute, wait, terminate answers ------------------------------------------------------------


def test_execute_two_phases() -> None:
    state = host()
    opened(state)
    actions = state.receive(execute(2))
    assert actions == [StartExecute(2, S1, ExecuteRequest("call-1", "text('x')", [], 5000, 1000))]
    sends = state.execution_started(2, CellId("g2:42"))
    assert sends is not None
    assert sent(sends) == [started(2, "g2:42")]
    assert state.in_flight(2)
    assert sent(state.initial_response(2, result("g2:42", "pong"))) == [initial(2, "g2:42", "pong")]
    assert not state.in_flight(2)
    assert state.initial_response(2, result("g2:42")) == []


def test_initial_response_errors() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    assert sent(state.operation_failed(2, "exec runtime ended unexpectedly")) == [
        ExecuteInitialResponse(2, WireError("exec runtime ended unexpectedly"))
    ]
    admitted(state, 3, "2")
    assert sent(state.initial_response(3, None, "boom")) == [
        ExecuteInitialResponse(3, WireError("boom"))
    ]


def test_execute_refused_by_the_runtime_has_no_initial_response() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    assert sent(state.operation_failed(2, "code mode session is shutting down")) == refused(
        2, "code mode session is shutting down"
    )
    assert state.initial_response(2, result("1")) == []


def test_wait_and_terminate_answers() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    assert state.receive(wait(3, "1", yield_ms=2**64 - 1)) == [
        StartWait(3, S1, WaitRequest(CellId("1"), 2**64 - 1))
    ]
    assert state.receive(terminate(4, "7")) == [StartTerminate(4, S1, CellId("7"))]
    live = LiveCell(Terminated(CellId("1"), [InputText("t")]))
    body = WireRuntimeResponse(terminated=WireTerminated("1", [WireInputText("t")]))
    assert sent(state.wait_completed(3, live)) == [
        ok(3, WaitCompleted(WireWaitOutcome(live_cell=body)))
    ]
    missing = MissingCell(Result(CellId("7"), [], "exec cell 7 not found"))
    missing_body = WireRuntimeResponse(result=WireResultBody("7", [], "exec cell 7 not found"))
    assert sent(state.wait_completed(4, missing)) == [
        ok(4, WaitCompleted(WireWaitOutcome(missing_cell=missing_body)))
    ]
    state.receive(wait(5, "1"))
    assert sent(state.operation_failed(5, "exec cell 1 already has an active observer")) == (
        refused(5, "exec cell 1 already has an active observer")
    )


def test_open_and_shutdown_answers() -> None:
    state = host()
    state.receive(open_(1, " s "))
    assert sent(state.session_opened(1)) == [ok(1, SessionReady(" s "))]
    assert state.session_opened(1) == []
    assert state.receive(shutdown(2, " s ")) == [StartShutdown(2, " s ")]
    assert sent(state.session_shut_down(2)) == [ok(2, SessionClosed(" s "))]
    assert state.session_shut_down(2) == []


# -- callbacks (§8.6) ----------------------------------------------------------------------------


def test_callback_ids_count_up_across_sessions() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    assert start_callback(state, "1") == (1, [DelegateRequestMessage(1, S1, tool("1"))])
    assert start_callback(state, "1", note("1"), S2) == (
        2,
        [DelegateRequestMessage(2, S2, note("1"))],
    )
    assert start_callback(state, "1") == (3, [DelegateRequestMessage(3, S1, tool("1"))])
    assert state.pending_callbacks == 3
    error = WireError("tool failed")
    assert state.receive(DelegateResponseMessage(2, WireOk(NotificationDelivered()))) == [
        ResolveCallback(2, WireOk(NotificationDelivered()))
    ]
    assert state.receive(DelegateResponseMessage(1, error)) == [ResolveCallback(1, error)]
    assert state.pending_callbacks == 1
    assert start_callback(state, "1")[0] == 4  # ids are never reused


def test_the_pending_callback_cap_is_1024() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    for expected in range(1, MAX_PENDING_DELEGATE_CALLS + 1):
        delegate_id, sends = start_callback(state, "1")
        assert delegate_id == expected
        assert len(sends) == 1
    assert state.pending_callbacks == MAX_PENDING_DELEGATE_CALLS
    # Over the cap: nothing is sent and no id is used (tool calls fail with J1, notes are dropped).
    assert start_callback(state, "1") == (None, [])
    assert start_callback(state, "1", note("1")) == (None, [])
    # Early callbacks of a cell being admitted count too.
    state.receive(execute(3))
    assert start_callback(state, "2") == (None, [])
    # Capacity returns as calls resolve: by an answer or a revocation.
    state.receive(answer(5))
    assert start_callback(state, "1") == (1025, [DelegateRequestMessage(1025, S1, tool("1"))])
    assert start_callback(state, "1") == (None, [])
    assert sent(state.revoke_callback(7)) == [DelegateCancel(7)]
    assert start_callback(state, "1")[0] == 1026
    assert start_callback(state, "1") == (None, [])


def test_a_session_cannot_take_the_slots_other_sessions_keep() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    greedy = MAX_PENDING_DELEGATE_CALLS - SESSION_CALLBACK_RESERVE
    for _ in range(greedy):
        assert start_callback(state, "1")[0] is not None
    # S1 reached what S2 leaves it: refused, while S2 still has its reserve.
    assert start_callback(state, "1") == (None, [])
    for _ in range(SESSION_CALLBACK_RESERVE):
        assert start_callback(state, "1", tool("1"), S2)[0] is not None
    assert state.pending_callbacks == MAX_PENDING_DELEGATE_CALLS
    assert start_callback(state, "1", tool("1"), S2) == (None, [])
    # A slot S1 gives back is S1's again; S2's reserve is used, so S2 is not favoured.
    state.receive(answer(1))
    assert start_callback(state, "1")[0] is not None


def test_early_callbacks_wait_for_execution_started() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    assert start_callback(state, "1") == (1, [])
    assert start_callback(state, "1", note("1")) == (2, [])
    assert state.pending_callbacks == 2
    sends = state.execution_started(2, CellId("1"))
    assert sends is not None
    assert sent(sends) == [
        started(2, "1"),
        DelegateRequestMessage(1, S1, tool("1")),
        DelegateRequestMessage(2, S1, note("1")),
    ]
    # Later callbacks go straight out.
    assert start_callback(state, "1") == (3, [DelegateRequestMessage(3, S1, tool("1"))])


def test_revoking_an_unsent_early_callback_sends_nothing() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    start_callback(state, "1")
    start_callback(state, "1", note("1"))
    assert state.revoke_callback(1) == []
    assert state.pending_callbacks == 1
    sends = state.execution_started(2, CellId("1"))
    assert sends is not None
    assert sent(sends) == [started(2, "1"), DelegateRequestMessage(2, S1, note("1"))]


def test_early_callbacks_of_a_cancelled_execute_are_never_sent() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    start_callback(state, "1")
    state.receive(OperationCancel(2))
    assert state.execution_started(2, CellId("1")) is None
    assert sent(state.operation_failed(2, CANCELLED)) == refused(2, H1)
    # The glue abandons the cell: the runtime cancels the call, then retires the cell.
    assert state.revoke_callback(1) == []
    assert state.cell_closed(S1, CellId("1")) == []
    assert state.pending_callbacks == 0
    assert state.receive(answer(1)) == []  # a (bogus) late answer for it is ignored
    state.receive(shutdown(3))
    assert sent(state.session_shut_down(3)) == [ok(3, SessionClosed(S1))]


def test_an_abandoned_cell_with_held_callbacks_releases_them() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    start_callback(state, "1")
    state.receive(OperationCancel(2))
    state.execution_started(2, CellId("1"))
    state.operation_failed(2, CANCELLED)
    # The cell closes while its callback is still held: nothing is sent, the slot is released.
    assert state.cell_closed(S1, CellId("1")) == []
    assert state.pending_callbacks == 0
    assert state.revoke_callback(1) == []


def test_revoke_sends_delegate_cancel_once() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    start_callback(state, "1")
    assert sent(state.revoke_callback(1)) == [DelegateCancel(1)]
    assert state.revoke_callback(1) == []
    assert state.pending_callbacks == 0
    # A response for a revoked id is ignored.
    assert state.receive(answer(1, "late")) == []
    assert state.receive(DelegateResponseMessage(1, WireError("late"))) == []


def test_a_response_for_an_answered_callback_is_l6() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    start_callback(state, "1")
    assert state.receive(answer(1, 5)) == [ResolveCallback(1, WireOk(ToolResult(5)))]
    with pytest.raises(ProtocolError) as caught:
        state.receive(answer(1, 5))
    assert caught.value.message == "code-mode client returned unknown delegate request ID 1"


@pytest.mark.parametrize("delegate_id", [99, 0, -1])
def test_a_response_for_a_never_issued_id_is_l6(delegate_id: int) -> None:
    state = host()
    with pytest.raises(ProtocolError) as caught:
        state.receive(answer(delegate_id))
    assert caught.value.message == (
        f"code-mode client returned unknown delegate request ID {delegate_id}"
    )


def test_the_last_4096_revoked_ids_are_remembered() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    for _ in range(RECENT_ID_MEMORY + 1):
        delegate_id, _sends = start_callback(state, "1")
        assert delegate_id is not None
        state.revoke_callback(delegate_id)
    assert state.receive(answer(2)) == []  # still remembered
    with pytest.raises(
        ProtocolError, match=r"^code-mode client returned unknown delegate request ID 1$"
    ):
        state.receive(answer(1))


def test_an_unsendable_callback_is_released_quietly() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    start_callback(state, "1")
    assert state.callback_unsent(1) == []
    assert state.callback_unsent(1) == []
    assert state.pending_callbacks == 0
    assert state.revoke_callback(1) == []
    assert state.receive(answer(1)) == []


# -- cell/closed and session/closed ordering (§8.3) ----------------------------------------------


def test_cell_closed_waits_for_the_initial_response() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    # The runtime retires a completed cell before the glue reports its initial response.
    assert state.cell_closed(S1, CellId("1")) == []
    assert state.active_cells == 1
    assert sent(state.initial_response(2, result("1"))) == [initial(2, "1"), cell_closed("1")]
    assert state.active_cells == 0
    assert state.cell_closed(S1, CellId("1")) == []  # exactly once


def test_cell_closed_after_an_error_initial_response() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    assert state.cell_closed(S1, CellId("1")) == []
    assert sent(state.operation_failed(2, "exec runtime ended unexpectedly")) == [
        ExecuteInitialResponse(2, WireError("exec runtime ended unexpectedly")),
        cell_closed("1"),
    ]


def test_cell_closed_waits_for_every_wait_and_terminate_naming_the_cell() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.receive(terminate(4, "1"))
    state.receive(terminate(5, "1"))
    state.receive(wait(6, "other"))  # names another cell: does not hold cell 1
    assert state.cell_closed(S1, CellId("1")) == []
    terminated = LiveCell(Terminated(CellId("1"), []))
    assert len(sent(state.wait_completed(3, terminated))) == 1
    assert len(sent(state.operation_failed(4, "exec cell 1 is already terminating"))) == 1
    missing = MissingCell(Result(CellId("other"), [], "exec cell other not found"))
    assert len(sent(state.wait_completed(6, missing))) == 1
    last = sent(state.wait_completed(5, terminated))
    assert last[1:] == [cell_closed("1")]
    assert isinstance(last[0], OperationResponse) and last[0].id == 5


def test_cell_closed_revokes_pending_callbacks_first() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    start_callback(state, "1")
    start_callback(state, "1", note("1"))
    assert sent(state.cell_closed(S1, CellId("1"))) == [
        DelegateCancel(1),
        DelegateCancel(2),
        cell_closed("1"),
    ]
    assert state.pending_callbacks == 0
    assert state.active_cells == 0
    assert state.receive(answer(1)) == []


def test_cell_closed_with_callbacks_and_an_open_answer() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    start_callback(state, "1")
    assert sent(state.cell_closed(S1, CellId("1"))) == [DelegateCancel(1)]
    assert sent(state.initial_response(2, result("1"))) == [initial(2, "1"), cell_closed("1")]


def test_a_wait_for_a_cell_admitted_later_does_not_hold_it() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    # A client that guesses the next cell id: the wait names a cell the host does not know yet.
    state.receive(wait(3, "1"))
    state.execution_started(2, CellId("1"))
    assert state.cell_closed(S1, CellId("1")) == []
    missing = MissingCell(Result(CellId("1"), [], "exec cell 1 not found"))
    assert len(sent(state.wait_completed(3, missing))) == 1  # no cell/closed yet
    assert sent(state.initial_response(2, result("1"))) == [initial(2, "1"), cell_closed("1")]


def test_no_cell_closed_for_a_cell_never_announced() -> None:
    state = host()
    opened(state)
    assert state.cell_closed(S1, CellId("9")) == []
    assert state.cell_closed("unknown", CellId("9")) == []
    assert state.active_cells == 0


def test_session_closed_follows_the_last_cell_closed() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    finished_cell(state, 3, "2")
    assert state.receive(shutdown(4)) == [StartShutdown(4, S1)]
    assert state.session_shut_down(4) == []
    assert state.in_flight(4)
    assert sent(state.cell_closed(S1, CellId("2"))) == [cell_closed("2")]
    assert sent(state.cell_closed(S1, CellId("1"))) == [
        cell_closed("1"),
        ok(4, SessionClosed(S1)),
    ]
    assert not state.in_flight(4)


def test_session_closed_when_the_cells_closed_first() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(shutdown(3))
    assert sent(state.cell_closed(S1, CellId("1"))) == [cell_closed("1")]
    assert sent(state.session_shut_down(3)) == [ok(3, SessionClosed(S1))]


def test_session_closed_waits_for_a_deferred_cell_closed() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    start_callback(state, "1")
    state.receive(shutdown(3))
    # Shutdown terminates the cell: the call is revoked, the cell retired, but the initial
    # response is still being produced.
    assert sent(state.cell_closed(S1, CellId("1"))) == [DelegateCancel(1)]
    assert state.session_shut_down(3) == []
    terminated = Terminated(CellId("1"), [])
    assert sent(state.initial_response(2, terminated)) == [
        ExecuteInitialResponse(2, WireOk(WireRuntimeResponse(terminated=WireTerminated("1", [])))),
        cell_closed("1"),
        ok(3, SessionClosed(S1)),
    ]


def test_sessions_close_independently() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    state.receive(shutdown(5, S1))
    assert state.session_shut_down(5) == []
    assert sent(state.cell_closed(S2, CellId("1"))) == [cell_closed("1", S2)]
    assert sent(state.cell_closed(S1, CellId("1"))) == [
        cell_closed("1", S1),
        ok(5, SessionClosed(S1)),
    ]
