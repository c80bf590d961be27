"""The sans-I/O V1 client state machine (``protocol-v1.md`` §9): every message, every K/D/C text,
every cancellation path. Messages are fed decoded; what comes out is compared exactly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from codemode.errors import CodeModeError, ConnectionClosed, ProtocolError, WireConversionError
from codemode.protocol.constants import (
    I32_MAX,
    I64_MAX,
    MAX_FRAME_BYTES,
    RECENT_ID_MEMORY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
    U64_MAX,
)
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
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
from codemode.protocol.v1.client_state import (
    CallbackCancelled,
    CallbackFailed,
    CallbackRequested,
    CellClosedEvent,
    ClientConnection,
    ConnectionFailed,
    Event,
    ExecutionStartedEvent,
    InitialResponse,
    NotificationAccepted,
    NotificationCallback,
    OperationFailed,
    Send,
    SessionForgotten,
    SessionOpened,
    SessionShutDown,
    ToolCallback,
    ToolReturned,
    WaitAnswered,
    delegate_failed,
    exited_with_status,
    message_type,
    not_json,
    read_failed,
    response_too_large,
    write_failed,
    wrong_lane,
)
from codemode.protocol.v1.codec import encode_frame
from codemode.protocol.v1.handshake import Negotiated
from codemode.protocol.v1.lanes import Lane
from codemode.protocol.v1.messages import (
    CellClosed,
    ClientToHost,
    ConnectionReady,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostResponse,
    InvalidHello,
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
    WireToolDefinition,
    WireToolName,
    WireWaitOutcome,
    WireWaitRequest,
    WireYielded,
)

S1 = "session-1"
CELL = "1"

# -- helpers -------------------------------------------------------------------------------------


def connection(*, limits: bool = True, first_request_id: int = 1) -> ClientConnection:
    granted = frozenset({SESSION_RESOURCE_LIMITS_CAPABILITY}) if limits else frozenset()
    return ClientConnection(Negotiated(granted, None), first_request_id=first_request_id)


def sent(events: Sequence[Event]) -> list[ClientToHost]:
    return [event.message for event in events if isinstance(event, Send)]


def others(events: Sequence[Event]) -> list[Event]:
    return [event for event in events if not isinstance(event, Send)]


def respond(request_id: int, value: HostResponse) -> OperationResponse:
    return OperationResponse(request_id, WireOk(value))


def refuse(request_id: int, message: str) -> OperationResponse:
    return OperationResponse(request_id, WireError(message))


def result_body(cell: str, text: str = "done") -> WireRuntimeResponse:
    return WireRuntimeResponse(result=WireResultBody(cell, [WireInputText(text)], None))


def yielded_body(cell: str) -> WireRuntimeResponse:
    return WireRuntimeResponse(yielded=WireYielded(cell, []))


def initial(request_id: int, cell: str, text: str = "done") -> ExecuteInitialResponse:
    return ExecuteInitialResponse(request_id, WireOk(result_body(cell, text)))


def live(request_id: int, cell: str) -> OperationResponse:
    return respond(request_id, WaitCompleted(WireWaitOutcome(live_cell=yielded_body(cell))))


def missing(request_id: int, cell: str) -> OperationResponse:
    body = WireRuntimeResponse(result=WireResultBody(cell, [], f"exec cell {cell} not found"))
    return respond(request_id, WaitCompleted(WireWaitOutcome(missing_cell=body)))


def invocation(cell: str = CELL, value: Any = None) -> WireNestedToolCall:
    return WireNestedToolCall(
        cell, "tool-1", WireToolName("echo", None), "function", {"v": 1} if value is None else value
    )


def tool_request(delegate_id: int, cell: str = CELL, session: str = S1) -> DelegateRequestMessage:
    return DelegateRequestMessage(delegate_id, session, ToolInvoke(invocation(cell)))


def note_request(delegate_id: int, cell: str = CELL, session: str = S1) -> DelegateRequestMessage:
    return DelegateRequestMessage(delegate_id, session, NotificationSend("call-1", cell, "hi"))


def error_response(delegate_id: int, message: str) -> DelegateResponseMessage:
    return DelegateResponseMessage(delegate_id, WireError(message))


REQUEST = ExecuteRequest("call-1", "text('x')", [], 5000, 1000)


def opened(conn: ClientConnection, limits: CodeModeSessionCellExecutionLimits | None = None) -> str:
    request_id, session_id, _ = conn.open_session(limits)
    assert conn.receive(respond(request_id, SessionReady(session_id))) == [
        SessionOpened(request_id, session_id)
    ]
    return session_id


def execute(conn: ClientConnection, session: str = S1) -> int:
    request_id, _ = conn.execute(session, REQUEST)
    return request_id


def start_cell(conn: ClientConnection, cell: str = CELL, session: str = S1) -> int:
    """Execute and admit ``cell``; returns the execute's request id."""
    request_id = execute(conn, session)
    events = conn.receive(respond(request_id, ExecutionStarted(cell)))
    assert events == [ExecutionStartedEvent(request_id, session, CellId(cell))]
    return request_id


def run_cell(conn: ClientConnection, cell: str = CELL, session: str = S1) -> int:
    """Execute, admit and deliver the initial response of ``cell``."""
    request_id = start_cell(conn, cell, session)
    conn.receive(initial(request_id, cell))
    return request_id


def protocol_error(text: str) -> Any:
    return pytest.raises(ProtocolError, match=r"^" + _escape(text) + "$")


def _escape(text: str) -> str:
    import re

    return re.escape(text)


# -- message texts -------------------------------------------------------------------------------


def test_text_builders() -> None:
    assert exited_with_status(1) == "code-mode host exited with status 1"
    assert read_failed("x") == "failed to read code-mode host message: x"
    assert write_failed("x") == "failed to write code-mode host message: x"
    assert (
        wrong_lane("cell/closed", Lane.BULK) == "code-mode host sent cell/closed on the bulk socket"
    )
    assert delegate_failed("x") == "code-mode delegate task failed: x"
    assert not_json("x") == "code-mode delegate returned a value that is not JSON: x"
    assert response_too_large("x") == "code-mode delegate response exceeds the IPC frame limit: x"
    assert message_type(DelegateCancel(1)) == "delegate/cancel"


# -- open ----------------------------------------------------------------------------------------


def test_open_allocates_request_and_session_ids_in_order() -> None:
    conn = connection()
    first = conn.open_session()
    second = conn.open_session()
    assert first[:2] == (1, "session-1")
    assert second[:2] == (2, "session-2")
    assert sent(first[2]) == [OperationRequest(1, SessionOpen("session-1"))]
    send = first[2][0]
    assert send.frame == encode_frame(send.message)
    assert send.lane is Lane.CONTROL


def test_open_with_limits_needs_the_capability() -> None:
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=250)
    _, _, sends = connection().open_session(limits)
    expected = SessionOpen(S1, WireSessionCellExecutionLimits(max_yield_time_ms=250))
    assert sent(sends) == [OperationRequest(1, expected)]

    conn = connection(limits=False)
    with pytest.raises(CodeModeError) as caught:
        conn.open_session(limits)
    assert caught.value.message == (
        "code-mode host does not support session resource limits: "
        "missing `session-cell-execution-resource-limits` capability"
    )
    # Nothing was consumed: default limits go through without the capability, as id 1.
    assert conn.open_session(CodeModeSessionCellExecutionLimits())[:2] == (1, S1)


def test_open_limits_out_of_range_fail_the_call_only() -> None:
    conn = connection()
    with pytest.raises(WireConversionError, match=r"^out of range integral type conversion"):
        conn.open_session(CodeModeSessionCellExecutionLimits(max_heap_size_bytes=U64_MAX + 1))
    assert conn.open_session()[:2] == (1, S1)


def test_open_answers() -> None:
    conn = connection()
    assert opened(conn) == S1
    request_id, session_id, _ = conn.open_session()
    events = conn.receive(refuse(request_id, "code-mode session ID `session-2` was reused"))
    assert events == [
        OperationFailed(request_id, "code-mode session ID `session-2` was reused"),
        SessionForgotten(session_id),
    ]


@pytest.mark.parametrize(
    "value", [SessionReady("session-9"), ExecutionStarted("1"), SessionClosed(S1)]
)
def test_invalid_open_response_is_k9(value: HostResponse) -> None:
    conn = connection()
    request_id, _, _ = conn.open_session()
    with protocol_error("code-mode host returned an invalid open-session response"):
        conn.receive(respond(request_id, value))


def test_cancelled_open_is_shut_down_when_ready_arrives() -> None:
    conn = connection()
    request_id, session_id, _ = conn.open_session()
    assert conn.cancel(request_id) == []
    events = conn.receive(respond(request_id, SessionReady(session_id)))
    assert sent(events) == [OperationRequest(2, SessionShutdown(session_id))]
    assert others(events) == []
    # Its session/closed is not reported to anyone; the session is just forgotten.
    assert conn.receive(respond(2, SessionClosed(session_id))) == [SessionForgotten(session_id)]
    assert conn.pending_requests() == 0


def test_cancelled_open_refused_is_silent() -> None:
    conn = connection()
    request_id, session_id, _ = conn.open_session()
    conn.cancel(request_id)
    assert conn.receive(refuse(request_id, "nope")) == [SessionForgotten(session_id)]


# -- execute -------------------------------------------------------------------------------------


def test_execute_two_phases() -> None:
    conn = connection()
    opened(conn)
    tool = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)
    request_id, sends = conn.execute(S1, ExecuteRequest("call-1", "1", [tool], None, 7))
    wire_tool = WireToolDefinition(
        "echo", WireToolName("echo", None), "Echo", "function", None, None
    )
    assert sent(sends) == [
        OperationRequest(
            request_id, SessionExecute(S1, WireExecuteRequest("call-1", [wire_tool], "1", None, 7))
        )
    ]
    assert conn.receive(respond(request_id, ExecutionStarted("g2:42"))) == [
        ExecutionStartedEvent(request_id, S1, CellId("g2:42"))
    ]
    assert conn.receive(initial(request_id, "g2:42", "out")) == [
        InitialResponse(request_id, Result(CellId("g2:42"), [InputText("out")], None))
    ]
    assert conn.pending_requests() == 0


def test_execute_refused_and_initial_error() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    assert conn.receive(refuse(request_id, "code-mode host has too many active cells")) == [
        OperationFailed(request_id, "code-mode host has too many active cells")
    ]
    request_id = start_cell(conn)
    error = ExecuteInitialResponse(request_id, WireError("remote runtime failed"))
    assert conn.receive(error) == [OperationFailed(request_id, "remote runtime failed")]


def test_execute_conversion_failure_sends_nothing() -> None:
    conn = connection()
    opened(conn)
    with pytest.raises(WireConversionError):
        conn.execute(S1, ExecuteRequest("c", "1", [], None, I32_MAX + 1))
    assert execute(conn) == 2  # id 2 after the open's id 1: nothing was consumed


@pytest.mark.parametrize("value", [SessionReady(S1), SessionClosed(S1)])
def test_invalid_execute_response_is_k10(value: HostResponse) -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    with protocol_error("code-mode host returned an invalid execute response"):
        conn.receive(respond(request_id, value))


def test_reused_live_cell_id_is_k16() -> None:
    conn = connection()
    opened(conn)
    opened(conn)
    start_cell(conn, "7")
    start_cell(conn, "7", "session-2")  # another session: fine
    request_id = execute(conn)
    with protocol_error("code-mode host reused live cell ID in session session-1"):
        conn.receive(respond(request_id, ExecutionStarted("7")))


def test_initial_response_for_another_cell_is_k15() -> None:
    conn = connection()
    opened(conn)
    request_id = start_cell(conn, "1")
    with protocol_error("code-mode host returned an initial response for cell 2 instead of 1"):
        conn.receive(initial(request_id, "2"))


def test_unknown_request_ids_are_k8() -> None:
    conn = connection()
    opened(conn)
    with protocol_error("code-mode host returned unknown request ID 99"):
        conn.receive(respond(99, SessionReady(S1)))
    with protocol_error("code-mode host returned unknown request ID 1"):
        conn.receive(respond(1, SessionReady(S1)))  # already answered
    request_id = execute(conn)
    with protocol_error(f"code-mode host returned unknown request ID {request_id}"):
        conn.receive(initial(request_id, CELL))  # before execution/started
    conn.receive(respond(request_id, ExecutionStarted(CELL)))
    with protocol_error(f"code-mode host returned unknown request ID {request_id}"):
        conn.receive(respond(request_id, ExecutionStarted("2")))  # a second operation/response
    conn.receive(initial(request_id, CELL))
    with protocol_error(f"code-mode host returned unknown request ID {request_id}"):
        conn.receive(initial(request_id, CELL))  # a second initial response
    wait_id, _ = conn.wait(S1, WaitRequest(CellId(CELL), 10))
    with protocol_error(f"code-mode host returned unknown request ID {wait_id}"):
        conn.receive(initial(wait_id, CELL))  # not an execute


def test_errors_leave_state_untouched() -> None:
    conn = connection()
    opened(conn)
    request_id = start_cell(conn)
    with pytest.raises(ProtocolError):
        conn.receive(initial(request_id, "other"))
    # The validation failed before any change: the right answer is still accepted.
    assert len(conn.receive(initial(request_id, CELL))) == 1


def test_operations_on_a_shut_down_session_are_c9() -> None:
    conn = connection()
    opened(conn)
    conn.shutdown(S1)
    for call in (
        lambda: conn.execute(S1, REQUEST),
        lambda: conn.wait(S1, WaitRequest(CellId(CELL), 1)),
        lambda: conn.terminate(S1, CellId(CELL)),
        lambda: conn.shutdown(S1),
        lambda: conn.execute("session-unknown", REQUEST),
    ):
        with pytest.raises(CodeModeError, match=r"^code mode session is shutting down$"):
            call()


# -- execute cancellation and abandonment ------------------------------------------------------------


def test_execute_cancelled_before_admission_then_refused() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    assert sent(conn.cancel(request_id)) == [OperationCancel(request_id)]
    assert conn.cancel(request_id) == []  # once
    assert conn.receive(refuse(request_id, "code-mode request cancelled")) == []
    assert conn.pending_requests() == 0


def test_execute_cancelled_before_admission_but_admitted_anyway() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    conn.cancel(request_id)
    events = conn.receive(respond(request_id, ExecutionStarted(CELL)))
    assert sent(events) == [OperationRequest(3, SessionTerminate(S1, CELL))]
    assert others(events) == []
    assert conn.receive(initial(request_id, CELL)) == []  # discarded
    assert conn.receive(live(3, CELL)) == []  # the terminate's outcome is discarded too
    # cell_closed still fires exactly once.
    assert conn.receive(CellClosed(S1, CELL)) == [CellClosedEvent(S1, CellId(CELL))]


def test_abandoned_before_admission_in_a_shutting_down_session_is_not_terminated() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    conn.cancel(request_id)
    conn.shutdown(S1)
    assert conn.receive(respond(request_id, ExecutionStarted(CELL))) == []


def test_started_cell_abandoned_before_its_initial_response() -> None:
    conn = connection()
    opened(conn)
    request_id = start_cell(conn)
    sends = conn.abandon_cell(S1, CellId(CELL), request_id)
    assert sent(sends) == [
        OperationCancel(request_id),
        OperationRequest(3, SessionTerminate(S1, CELL)),
    ]
    assert conn.abandon_cell(S1, CellId(CELL), request_id) == []  # idempotent
    assert conn.receive(initial(request_id, CELL)) == []


def test_started_cell_abandoned_after_its_initial_response() -> None:
    conn = connection()
    opened(conn)
    request_id = run_cell(conn)
    assert sent(conn.abandon_cell(S1, CellId(CELL), request_id)) == [
        OperationRequest(3, SessionTerminate(S1, CELL))
    ]


def test_closed_cell_is_not_terminated_on_abandonment() -> None:
    conn = connection()
    opened(conn)
    request_id = run_cell(conn)
    conn.receive(CellClosed(S1, CELL))
    assert conn.abandon_cell(S1, CellId(CELL), request_id) == []


def test_abandonment_while_shutting_down_only_cancels() -> None:
    conn = connection()
    opened(conn)
    request_id = start_cell(conn)
    conn.shutdown(S1)
    assert sent(conn.abandon_cell(S1, CellId(CELL), request_id)) == [OperationCancel(request_id)]


def test_cancel_racing_execution_started_abandons_the_cell() -> None:
    conn = connection()
    opened(conn)
    request_id = start_cell(conn)
    assert sent(conn.cancel(request_id)) == [
        OperationCancel(request_id),
        OperationRequest(3, SessionTerminate(S1, CELL)),
    ]


# -- wait ----------------------------------------------------------------------------------------


def test_wait_answers() -> None:
    conn = connection()
    opened(conn)
    request_id, sends = conn.wait(S1, WaitRequest(CellId(CELL), 250))
    assert sent(sends) == [
        OperationRequest(request_id, SessionWait(S1, WireWaitRequest(CELL, 250)))
    ]
    assert conn.receive(live(request_id, CELL)) == [
        WaitAnswered(request_id, LiveCell(Yielded(CellId(CELL), [])))
    ]
    request_id, _ = conn.wait(S1, WaitRequest(CellId("9"), 1))
    assert conn.receive(missing(request_id, "9")) == [
        WaitAnswered(request_id, MissingCell(Result(CellId("9"), [], "exec cell 9 not found")))
    ]
    request_id, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    busy = "exec cell 1 already has an active observer"
    assert conn.receive(refuse(request_id, busy)) == [OperationFailed(request_id, busy)]


def test_wait_conversion_failure() -> None:
    conn = connection()
    opened(conn)
    with pytest.raises(WireConversionError):
        conn.wait(S1, WaitRequest(CellId(CELL), -1))


@pytest.mark.parametrize("answer", [live, missing])
def test_wait_outcome_for_another_cell_is_k14(answer: Any) -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.wait(S1, WaitRequest(CellId("1"), 1))
    with protocol_error("code-mode host returned cell 2 for request targeting 1"):
        conn.receive(answer(request_id, "2"))


@pytest.mark.parametrize("value", [SessionReady(S1), ExecutionStarted("1"), SessionClosed(S1)])
def test_invalid_cell_response_is_k11(value: HostResponse) -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.wait(S1, WaitRequest(CellId("1"), 1))
    with protocol_error("code-mode host returned an invalid cell response"):
        conn.receive(respond(request_id, value))
    request_id, _ = conn.terminate(S1, CellId("1"))
    with protocol_error("code-mode host returned an invalid cell response"):
        conn.receive(respond(request_id, value))


def test_cancelled_wait_discards_even_a_real_outcome_but_still_validates_it() -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    assert sent(conn.cancel(request_id)) == [OperationCancel(request_id)]
    assert conn.cancel(request_id) == []
    with protocol_error(f"code-mode host returned cell 2 for request targeting {CELL}"):
        conn.receive(live(request_id, "2"))
    assert conn.receive(live(request_id, CELL)) == []


def test_wait_deferred_behind_a_cancelled_wait() -> None:
    conn = connection()
    opened(conn)
    first, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    conn.cancel(first)
    second, sends = conn.wait(S1, WaitRequest(CellId(CELL), 2))
    third, more = conn.wait(S1, WaitRequest(CellId(CELL), 3))
    assert sends == [] and more == []
    with protocol_error(f"code-mode host returned unknown request ID {second}"):
        conn.receive(live(second, CELL))  # never sent: unknown to the host
    events = conn.receive(refuse(first, "code-mode request cancelled"))
    assert sent(events) == [
        OperationRequest(second, SessionWait(S1, WireWaitRequest(CELL, 2))),
        OperationRequest(third, SessionWait(S1, WireWaitRequest(CELL, 3))),
    ]
    assert conn.receive(live(second, CELL)) == [
        WaitAnswered(second, LiveCell(Yielded(CellId(CELL), [])))
    ]


def test_queued_wait_cancelled_is_dropped_unsent() -> None:
    conn = connection()
    opened(conn)
    first, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    conn.cancel(first)
    second, _ = conn.wait(S1, WaitRequest(CellId(CELL), 2))
    assert conn.cancel(second) == []
    assert conn.receive(live(first, CELL)) == []
    assert conn.pending_requests() == 0


def test_wait_deferral_is_per_session_and_cell() -> None:
    conn = connection()
    opened(conn)
    opened(conn)
    first, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    conn.cancel(first)
    assert conn.wait(S1, WaitRequest(CellId("2"), 1))[1] != []
    assert conn.wait("session-2", WaitRequest(CellId(CELL), 1))[1] != []


def test_deferral_waits_for_every_cancelled_wait_of_the_cell() -> None:
    conn = connection()
    opened(conn)
    a, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    b, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))  # the host answers it "busy"
    conn.cancel(a)
    conn.cancel(b)
    c, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    assert sent(conn.receive(live(a, CELL))) == []
    assert sent(conn.receive(refuse(b, "busy"))) == [
        OperationRequest(c, SessionWait(S1, WireWaitRequest(CELL, 1)))
    ]


# -- terminate -----------------------------------------------------------------------------------


def test_terminate() -> None:
    conn = connection()
    opened(conn)
    request_id, sends = conn.terminate(S1, CellId(CELL))
    assert sent(sends) == [OperationRequest(request_id, SessionTerminate(S1, CELL))]
    outcome = WireWaitOutcome(live_cell=WireRuntimeResponse(terminated=WireTerminated(CELL, [])))
    assert conn.receive(respond(request_id, WaitCompleted(outcome))) == [
        WaitAnswered(request_id, LiveCell(Terminated(CellId(CELL), [])))
    ]
    request_id, _ = conn.terminate(S1, CellId("5"))
    with protocol_error("code-mode host returned cell 1 for request targeting 5"):
        conn.receive(missing(request_id, CELL))


def test_cancelled_terminate_is_not_cancelled_on_the_wire() -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.terminate(S1, CellId(CELL))
    assert conn.cancel(request_id) == []
    assert conn.receive(live(request_id, CELL)) == []


# -- shutdown ------------------------------------------------------------------------------------


def test_shutdown() -> None:
    conn = connection()
    opened(conn)
    request_id, events = conn.shutdown(S1)
    assert sent(events) == [OperationRequest(request_id, SessionShutdown(S1))]
    assert conn.receive(respond(request_id, SessionClosed(S1))) == [
        SessionShutDown(request_id, S1),
        SessionForgotten(S1),
    ]


@pytest.mark.parametrize("value", [SessionClosed("session-2"), SessionReady(S1)])
def test_invalid_shutdown_response_is_k12(value: HostResponse) -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.shutdown(S1)
    with protocol_error("code-mode host returned an invalid shutdown response"):
        conn.receive(respond(request_id, value))


def test_shutdown_error_is_k13() -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.shutdown(S1)
    with protocol_error("code-mode host failed to shut down session session-1: boom"):
        conn.receive(refuse(request_id, "boom"))


def test_shutdown_waits_for_every_cell_closed() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    request_id, _ = conn.shutdown(S1)
    assert conn.receive(DelegateCancel(1)) == [CallbackCancelled(1)]
    assert conn.receive(CellClosed(S1, CELL)) == []  # its callback task still runs
    assert conn.receive(respond(request_id, SessionClosed(S1))) == []
    assert conn.open_cells(S1) == 1
    assert conn.finish_callback(1, ToolReturned(1)) == [
        CellClosedEvent(S1, CellId(CELL)),
        SessionShutDown(request_id, S1),
        SessionForgotten(S1),
    ]


def test_shutdown_fails_executes_awaiting_admission_with_c10() -> None:
    conn = connection()
    opened(conn)
    pending = execute(conn)
    cancelled = execute(conn)
    conn.cancel(cancelled)
    request_id, events = conn.shutdown(S1)
    assert sent(events) == [
        OperationRequest(request_id, SessionShutdown(S1)),
        OperationCancel(pending),
    ]
    assert others(events) == [OperationFailed(pending, "code-mode session closed during execute")]
    assert conn.receive(refuse(pending, "code-mode request cancelled")) == []


def test_session_closed_fails_a_missing_initial_response_with_c10() -> None:
    conn = connection()
    opened(conn)
    started = start_cell(conn)
    request_id, _ = conn.shutdown(S1)
    # A host that (wrongly) closes the session without the cell's initial response and cell/closed.
    events = conn.receive(respond(request_id, SessionClosed(S1)))
    assert events == [
        OperationFailed(started, "code-mode session closed during execute"),
        CellClosedEvent(S1, CellId(CELL)),
        SessionShutDown(request_id, S1),
        SessionForgotten(S1),
    ]


# -- callbacks -----------------------------------------------------------------------------------


def test_tool_callback_round_trip_and_lanes() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    events = conn.receive(tool_request(1))
    call = CodeModeNestedToolCall(
        CellId(CELL), "tool-1", ToolName("echo"), CodeModeToolKind.FUNCTION, {"v": 1}
    )
    assert events == [CallbackRequested(1, S1, ToolCallback(call))]
    assert conn.unresolved_callbacks() == 1
    (send,) = conn.finish_callback(1, ToolReturned({"ok": [1, None]}))
    assert isinstance(send, Send)
    assert send.message == DelegateResponseMessage(1, WireOk(ToolResult({"ok": [1, None]})))
    assert send.lane is Lane.BULK
    assert conn.unresolved_callbacks() == 0

    conn.receive(tool_request(2))
    (send,) = conn.finish_callback(2, ToolReturned(None))
    assert isinstance(send, Send)
    assert send.message == DelegateResponseMessage(2, WireOk(ToolResult(None)))


def test_notification_callback_round_trip_and_lanes() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    assert conn.receive(note_request(1)) == [
        CallbackRequested(1, S1, NotificationCallback("call-1", CellId(CELL), "hi"))
    ]
    (send,) = conn.finish_callback(1, NotificationAccepted())
    assert isinstance(send, Send)
    assert send.message == DelegateResponseMessage(1, WireOk(NotificationDelivered()))
    assert send.lane is Lane.CONTROL
    conn.receive(note_request(2))
    (send,) = conn.finish_callback(2, CallbackFailed("nope"))
    assert isinstance(send, Send)
    assert send.message == error_response(2, "nope")
    assert send.lane is Lane.BULK  # every error goes on bulk, even a notification's


def test_callback_failures_are_sent_unchanged() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    assert sent(conn.finish_callback(1, CallbackFailed("boom"))) == [error_response(1, "boom")]


def test_non_json_result_is_d5() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    (message,) = sent(conn.finish_callback(1, ToolReturned({"x": object()})))
    assert isinstance(message, DelegateResponseMessage)
    assert isinstance(message.result, WireError)
    assert message.result.message.startswith(
        "code-mode delegate returned a value that is not JSON: "
    )
    assert "failed to encode" not in message.result.message
    assert "object" in message.result.message


@pytest.mark.slow
def test_oversize_result_is_d6() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    (message,) = sent(conn.finish_callback(1, ToolReturned("x" * MAX_FRAME_BYTES)))
    assert isinstance(message, DelegateResponseMessage)
    assert isinstance(message.result, WireError)
    assert message.result.message.startswith(
        "code-mode delegate response exceeds the IPC frame limit: code-mode IPC frame length "
    )
    assert message.result.message.endswith(f" exceeds {MAX_FRAME_BYTES} bytes")


def test_duplicate_delegate_ids_are_k17() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    with protocol_error("duplicate code-mode delegate request ID 1"):
        conn.receive(tool_request(1))  # active
    conn.finish_callback(1, ToolReturned(1))
    with protocol_error("duplicate code-mode delegate request ID 1"):
        conn.receive(note_request(1))  # finished
    conn.receive(tool_request(2))
    conn.receive(DelegateCancel(2))
    with protocol_error("duplicate code-mode delegate request ID 2"):
        conn.receive(tool_request(2))  # revoked, task still running
    conn.finish_callback(2, ToolReturned(1))
    with protocol_error("duplicate code-mode delegate request ID 2"):
        conn.receive(tool_request(2))  # revoked and finished
    conn.receive(tool_request(3, cell="nope"))  # answered D3 at once
    with protocol_error("duplicate code-mode delegate request ID 3"):
        conn.receive(tool_request(3))


def test_only_the_last_4096_finished_delegate_ids_are_remembered() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    for delegate_id in range(1, RECENT_ID_MEMORY + 2):
        conn.receive(tool_request(delegate_id))
        conn.finish_callback(delegate_id, ToolReturned(None))
    assert len(conn.receive(tool_request(1))) == 1  # forgotten: accepted again
    with pytest.raises(ProtocolError):
        conn.receive(tool_request(2))


def test_pending_callback_cap_is_d1() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    for delegate_id in range(1, 1025):
        conn.receive(tool_request(delegate_id))
    limit = "code-mode host exceeded the limit of 1024 pending delegate calls"
    assert sent(conn.receive(tool_request(1025))) == [error_response(1025, limit)]
    with protocol_error("duplicate code-mode delegate request ID 1025"):
        conn.receive(tool_request(1025))
    # A revoked callback no longer counts, even while its task runs.
    conn.receive(DelegateCancel(1))
    assert conn.unresolved_callbacks() == 1023
    assert conn.receive(tool_request(1026)) == [
        CallbackRequested(1026, S1, ToolCallback(conn_call()))
    ]
    assert sent(conn.receive(note_request(1027))) == [error_response(1027, limit)]


def conn_call() -> CodeModeNestedToolCall:
    return CodeModeNestedToolCall(
        CellId(CELL), "tool-1", ToolName("echo"), CodeModeToolKind.FUNCTION, {"v": 1}
    )


def test_parked_callbacks_count_against_the_cap() -> None:
    conn = connection()
    opened(conn)
    execute(conn)
    for delegate_id in range(1, 1025):
        assert conn.receive(tool_request(delegate_id)) == []
    assert sent(conn.receive(tool_request(1025))) == [
        error_response(1025, "code-mode host exceeded the limit of 1024 pending delegate calls")
    ]


def test_unknown_session_is_d2() -> None:
    conn = connection()
    text = "code-mode host delegated for unknown session {}"
    assert sent(conn.receive(tool_request(1, session="nope"))) == [
        error_response(1, text.format("nope"))
    ]
    request_id, session_id, _ = conn.open_session()
    assert sent(conn.receive(tool_request(2, session=session_id))) == [
        error_response(2, text.format(session_id))  # still opening
    ]
    conn.receive(respond(request_id, SessionReady(session_id)))
    shutdown_id, _ = conn.shutdown(session_id)
    conn.receive(respond(shutdown_id, SessionClosed(session_id)))
    assert sent(conn.receive(note_request(3, session=session_id))) == [
        error_response(3, text.format(session_id))  # closed
    ]


def test_unknown_cell_is_d3() -> None:
    conn = connection()
    opened(conn)
    text = "code-mode host delegated for unknown cell 5 in session session-1"
    assert sent(conn.receive(tool_request(1, cell="5"))) == [error_response(1, text)]
    run_cell(conn, "5")
    conn.receive(CellClosed(S1, "5"))
    assert sent(conn.receive(note_request(2, cell="5"))) == [error_response(2, text)]
    assert conn.receive(DelegateCancel(2)) == []  # a late cancel is ignored


def test_early_callback_is_parked_until_its_cell_starts() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    assert conn.receive(tool_request(1)) == []
    assert conn.receive(note_request(2)) == []
    assert conn.unresolved_callbacks() == 2
    assert conn.receive(respond(request_id, ExecutionStarted(CELL))) == [
        ExecutionStartedEvent(request_id, S1, CellId(CELL)),
        CallbackRequested(1, S1, ToolCallback(conn_call())),
        CallbackRequested(2, S1, NotificationCallback("call-1", CellId(CELL), "hi")),
    ]
    assert conn.unresolved_callbacks() == 2


def test_parked_callback_for_another_cell_is_d3_once_nothing_awaits_admission() -> None:
    conn = connection()
    opened(conn)
    first = execute(conn)
    second = execute(conn)
    conn.receive(tool_request(1, cell="2"))
    conn.receive(tool_request(3, cell="9"))
    assert conn.receive(respond(first, ExecutionStarted(CELL))) == [
        ExecutionStartedEvent(first, S1, CellId(CELL))
    ]
    events = conn.receive(respond(second, ExecutionStarted("2")))
    assert others(events) == [
        ExecutionStartedEvent(second, S1, CellId("2")),
        CallbackRequested(1, S1, ToolCallback(conn_call_for("2"))),
    ]
    assert sent(events) == [
        error_response(3, "code-mode host delegated for unknown cell 9 in session session-1")
    ]
    assert conn.unresolved_callbacks() == 1


def conn_call_for(cell: str) -> CodeModeNestedToolCall:
    return CodeModeNestedToolCall(
        CellId(cell), "tool-1", ToolName("echo"), CodeModeToolKind.FUNCTION, {"v": 1}
    )


def test_parked_callback_refused_when_the_execute_fails() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    conn.receive(tool_request(1))
    events = conn.receive(refuse(request_id, "code-mode host has too many active cells"))
    assert sent(events) == [
        error_response(1, "code-mode host delegated for unknown cell 1 in session session-1")
    ]
    assert others(events) == [
        OperationFailed(request_id, "code-mode host has too many active cells")
    ]
    with protocol_error("duplicate code-mode delegate request ID 1"):
        conn.receive(tool_request(1))


def test_cancel_of_a_parked_callback_removes_it_silently() -> None:
    conn = connection()
    opened(conn)
    request_id = execute(conn)
    conn.receive(tool_request(1))
    assert conn.receive(DelegateCancel(1)) == []
    assert conn.unresolved_callbacks() == 0
    assert conn.receive(respond(request_id, ExecutionStarted(CELL))) == [
        ExecutionStartedEvent(request_id, S1, CellId(CELL))
    ]
    with protocol_error("duplicate code-mode delegate request ID 1"):
        conn.receive(tool_request(1))


def test_delegate_cancel_suppresses_the_response() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    assert conn.receive(DelegateCancel(1)) == [CallbackCancelled(1)]
    assert conn.receive(DelegateCancel(1)) == []
    assert conn.receive(DelegateCancel(77)) == []  # unknown: ignored
    assert conn.finish_callback(1, ToolReturned("late")) == []


def test_cell_closed_revokes_callbacks_and_fires_once_after_them() -> None:
    conn = connection()
    opened(conn)
    run_cell(conn)
    conn.receive(tool_request(1))
    conn.receive(note_request(2))
    conn.receive(tool_request(3))
    conn.receive(DelegateCancel(3))
    assert conn.receive(CellClosed(S1, CELL)) == [CallbackCancelled(1), CallbackCancelled(2)]
    assert conn.finish_callback(2, NotificationAccepted()) == []
    assert conn.finish_callback(3, ToolReturned(None)) == []
    assert conn.finish_callback(1, ToolReturned(None)) == [CellClosedEvent(S1, CellId(CELL))]
    with protocol_error("code-mode host closed unknown cell 1 in session session-1"):
        conn.receive(CellClosed(S1, CELL))


def test_cell_closed_for_unknown_cells_is_k18() -> None:
    conn = connection()
    opened(conn)
    with protocol_error("code-mode host closed unknown cell 4 in session session-1"):
        conn.receive(CellClosed(S1, "4"))
    with protocol_error("code-mode host closed unknown cell 1 in session session-7"):
        conn.receive(CellClosed("session-7", "1"))


def test_finish_of_an_unknown_callback_is_a_programming_error() -> None:
    with pytest.raises(KeyError):
        connection().finish_callback(1, ToolReturned(None))


# -- connection errors and death ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        ConnectionReady(1, ()),
        ConnectionRejected(InvalidHello("first message must be connection/hello")),
    ],
)
def test_second_handshake_response_is_k5(message: Any) -> None:
    conn = connection()
    with protocol_error("code-mode host sent a second handshake response"):
        conn.receive(message)


def test_request_id_exhaustion_is_k19() -> None:
    conn = connection(first_request_id=I64_MAX)
    request_id, session_id, _ = conn.open_session()
    assert request_id == I64_MAX
    conn.receive(respond(request_id, SessionReady(session_id)))
    with protocol_error("code-mode host request ID space exhausted"):
        conn.execute(session_id, REQUEST)
    assert conn.is_alive()  # the driver records the failure with fail()


def test_fail_fails_everything_once() -> None:
    conn = connection()
    opened(conn)
    open_id, _, _ = conn.open_session()
    admitting = execute(conn)
    started = start_cell(conn, "2")
    cancelled_wait, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    conn.cancel(cancelled_wait)
    queued, _ = conn.wait(S1, WaitRequest(CellId(CELL), 1))
    terminate, _ = conn.terminate(S1, CellId("2"))
    run_cell(conn, "3")
    conn.receive(tool_request(1, cell="3"))
    conn.receive(tool_request(2, cell="9"))  # parked behind the admitting execute
    reason = "code-mode host exited with status 1"
    events = conn.fail(reason)
    assert events == [
        ConnectionFailed(reason),
        OperationFailed(open_id, reason, connection_lost=True),
        OperationFailed(admitting, reason, connection_lost=True),
        OperationFailed(started, reason, connection_lost=True),
        OperationFailed(queued, reason, connection_lost=True),
        OperationFailed(terminate, reason, connection_lost=True),
        CellClosedEvent(S1, CellId("2")),
        CallbackCancelled(1),
    ]
    assert not conn.is_alive() and conn.failure == reason
    assert conn.fail("code-mode host connection closed") == []
    assert conn.failure == reason
    assert conn.receive(CellClosed(S1, "3")) == []  # ignored after death
    assert conn.open_cells(S1) == 1
    # The running callback's answer is suppressed; its cell then closes.
    assert conn.finish_callback(1, ToolReturned(None)) == [CellClosedEvent(S1, CellId("3"))]
    assert conn.open_cells(S1) == 0
    for call in (
        conn.open_session,
        lambda: conn.execute(S1, REQUEST),
        lambda: conn.wait(S1, WaitRequest(CellId(CELL), 1)),
        lambda: conn.terminate(S1, CellId(CELL)),
        lambda: conn.shutdown(S1),
    ):
        with pytest.raises(ConnectionClosed, match=r"^code-mode host exited with status 1$"):
            call()
    assert conn.cancel(started) == []
    assert conn.abandon_cell(S1, CellId("2"), started) == []


def test_fail_fails_a_pending_shutdown() -> None:
    conn = connection()
    opened(conn)
    request_id, _ = conn.shutdown(S1)
    assert conn.fail("x") == [ConnectionFailed("x"), OperationFailed(request_id, "x", True)]
