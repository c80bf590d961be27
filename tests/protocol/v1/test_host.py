"""The sans-I/O V1 host machine (``protocol-v1.md`` §3, §6, §7.3, §8): the handshake, every
client message, every host rule and every H/J/L text.

Client messages are fed decoded (``receive``) or as bytes (``receive_data``, ``receive_frame``);
what comes out is compared exactly: the events, and every frame of ``data_to_send()`` decoded back
with the lane it was queued for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final, cast

import msgspec
import pytest

from codemode.errors import FrameError
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    MAX_FRAME_BYTES,
    MAX_PENDING_DELEGATE_CALLS,
    RECENT_ID_MEMORY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    NotificationAccepted,
    ToolReturned,
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
    ToolName,
    WaitRequest,
    Yielded,
)
from codemode.protocol.v1.codec import MessageDecoder, encode_frame, encode_payload
from codemode.protocol.v1.conversions import nested_tool_call_to_wire, wait_outcome_to_wire
from codemode.protocol.v1.events import (
    CallbackResolved,
    CancelOperation,
    ConnectionEnded,
    HandshakeComplete,
    HostEvent,
    OpenSession,
    StartExecute,
    StartShutdown,
    StartTerminate,
    StartWait,
)
from codemode.protocol.v1.handshake import Negotiated
from codemode.protocol.v1.host import SESSION_CALLBACK_RESERVE, HostProtocol
from codemode.protocol.v1.lanes import Lane
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
from codemode.protocol.v1.revision import WireRevision

S1 = "session-1"
S2 = "session-2"
LIMITS = SESSION_RESOURCE_LIMITS_CAPABILITY
DUAL = DUAL_WEBSOCKET_CAPABILITY
NO_LIMITS = CodeModeSessionCellExecutionLimits()
EXECUTE = ExecuteRequest("call-1", "text('x')", [], 5000, 1000)

H1 = "code-mode request cancelled"
H2 = "code-mode host has too many in-flight requests"
H3 = "code-mode host has too many active cells"
H4 = "code-mode host is shutting down"
H9 = (
    "invalid code-mode session execution limits: capability "
    "`session-cell-execution-resource-limits` was not negotiated"
)
X1 = "out of range integral type conversion attempted"
J1 = "code-mode host exceeded the limit of 1024 pending delegate calls"
J2 = "code-mode client returned an invalid tool result"
J3 = "code-mode client returned an invalid notification result"
J4 = "code-mode client connection closed"
L3 = "received a second code-mode client hello"
FRAME_LIMIT = f"exceeds {MAX_FRAME_BYTES} bytes"

_CLIENT_DECODER: Final = MessageDecoder[ClientToHost](ClientToHost)


# -- helpers -------------------------------------------------------------------------------------


def frames(state: HostProtocol) -> list[tuple[HostToClient, Lane]]:
    """Every frame ``data_to_send()`` holds, decoded in the host's wire revision, and its lane."""
    decoder = MessageDecoder[HostToClient](HostToClient, state.wire_revision)
    decoded: list[tuple[HostToClient, Lane]] = []
    for frame, lane in state.data_to_send():
        assert int.from_bytes(frame[:4], "little") == len(frame) - 4
        decoded.append((decoder.decode(bytes(frame[4:])), lane))
    return decoded


def out(state: HostProtocol) -> tuple[list[HostEvent], list[HostToClient]]:
    """The events and the messages sent since the last look (single sockets use control only)."""
    events = state.events_received()
    queued = frames(state)
    if state.negotiated is None or not state.negotiated.dual_websocket:
        assert all(lane is Lane.CONTROL for _, lane in queued)
    return events, [message for message, _ in queued]


def sent(state: HostProtocol) -> list[HostToClient]:
    """The messages sent since the last look; no event may have happened."""
    events, messages = out(state)
    assert events == [], f"unexpected events {events!r}"
    return messages


def exchange(
    state: HostProtocol, message: ClientToHost, lane: Lane = Lane.CONTROL
) -> tuple[list[HostEvent], list[HostToClient]]:
    """Receive ``message``: what happened, what was sent."""
    state.receive(message, lane)
    return out(state)


def hello(*optional: str, required: Sequence[str] = ()) -> ConnectionHello:
    return ConnectionHello((1,), tuple(required), tuple(optional))


def host(*optional: str, **options: Any) -> HostProtocol:
    """A host whose handshake succeeded; the client lists ``optional`` (default: limits)."""
    state = HostProtocol(**options)
    events, messages = exchange(state, hello(*(optional or (LIMITS,))))
    assert len(messages) == 1 and isinstance(messages[0], ConnectionReady)
    assert state.negotiated is not None
    assert events == [HandshakeComplete(state.negotiated)]
    return state


def sent_after_handshake(state: HostProtocol) -> list[HostToClient]:
    events, messages = out(state)
    assert state.negotiated is not None
    assert events == [HandshakeComplete(state.negotiated)]
    return messages


def dual_host() -> HostProtocol:
    return host(LIMITS, DUAL, capabilities=(LIMITS, DUAL), new_token=lambda: "tok")


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


def tool_call(cell: str, value: Any = 1) -> CodeModeNestedToolCall:
    return CodeModeNestedToolCall(
        CellId(cell), "tool-1", ToolName("echo"), CodeModeToolKind.FUNCTION, {"v": value}
    )


def wire_tool(cell: str) -> ToolInvoke:
    return ToolInvoke(
        WireNestedToolCall(cell, "tool-1", WireToolName("echo", None), "function", {"v": 1})
    )


def wire_note(cell: str, text: str = "hi") -> NotificationSend:
    return NotificationSend("call-1", cell, text)


def delegated(delegate_id: int, body: DelegateRequest, session: str = S1) -> DelegateRequestMessage:
    return DelegateRequestMessage(delegate_id, session, body)


def call(
    state: HostProtocol, cell: str, session: str = S1
) -> tuple[int, list[HostEvent], list[HostToClient]]:
    """Start a tool call from ``cell``: its id, the events, what was sent."""
    delegate_id = state.start_tool_call(session, tool_call(cell))
    return (delegate_id, *out(state))


def note(
    state: HostProtocol, cell: str, session: str = S1, text: str = "hi"
) -> tuple[int, list[HostEvent], list[HostToClient]]:
    """Start a notification from ``cell``: its id, the events, what was sent."""
    delegate_id = state.start_notification(session, "call-1", CellId(cell), text)
    return (delegate_id, *out(state))


def resolved(delegate_id: int, outcome: CallbackResult | str) -> CallbackResolved:
    """``CallbackResolved``; a string is a ``CallbackFailed`` message."""
    if isinstance(outcome, str):
        outcome = CallbackFailed(outcome)
    return CallbackResolved(delegate_id, outcome)


def answer(delegate_id: int, value: Any = None) -> DelegateResponseMessage:
    return DelegateResponseMessage(delegate_id, WireOk(ToolResult(value)))


def delivered(delegate_id: int) -> DelegateResponseMessage:
    return DelegateResponseMessage(delegate_id, WireOk(NotificationDelivered()))


def opened(state: HostProtocol, request_id: int = 1, session: str = S1) -> None:
    """Open ``session`` with request ``request_id`` and report success."""
    assert exchange(state, open_(request_id, session)) == (
        [OpenSession(request_id, session, NO_LIMITS)],
        [],
    )
    state.session_opened(request_id)
    assert sent(state) == [ok(request_id, SessionReady(session))]


def admitted(state: HostProtocol, request_id: int, cell: str, session: str = S1) -> None:
    """Execute in ``session`` with request ``request_id``; the runtime admits ``cell``."""
    assert exchange(state, execute(request_id, session)) == (
        [StartExecute(request_id, session, EXECUTE)],
        [],
    )
    assert state.execution_started(request_id, CellId(cell)) is True
    assert sent(state) == [started(request_id, cell)]


def finished_cell(state: HostProtocol, request_id: int, cell: str, session: str = S1) -> None:
    """An admitted cell that already delivered its initial response (a running, yielded cell)."""
    admitted(state, request_id, cell, session)
    state.initial_response(request_id, Yielded(CellId(cell), []))
    assert sent(state) == [
        ExecuteInitialResponse(
            request_id, WireOk(WireRuntimeResponse(yielded=WireYielded(cell, [])))
        )
    ]


def decode_error(payload: bytes) -> str:
    """The exact decode error text of a client payload."""
    with pytest.raises(FrameError) as caught:
        _CLIENT_DECODER.decode(payload)
    return caught.value.message


class FakeClock:
    """A monotonic clock the test sets by hand."""

    def __init__(self, now: int = 0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.now


def no_clock() -> int:
    raise AssertionError("the pinned revision must not read the clock")


# -- handshake (§3.3) ------------------------------------------------------------------------------


def test_nothing_happens_before_the_hello() -> None:
    state = HostProtocol()
    assert out(state) == ([], [])
    assert state.negotiated is None
    assert not state.ended
    assert state.failure is None


def test_ready_grants_limits_and_matches_the_example_bytes() -> None:
    state = HostProtocol()
    state.receive(hello(LIMITS))
    payload = (
        b'{"type":"connection/ready","selectedVersion":1,'
        b'"capabilities":["session-cell-execution-resource-limits"]}'
    )
    assert state.data_to_send() == [(len(payload).to_bytes(4, "little") + payload, Lane.CONTROL)]
    negotiated = Negotiated(frozenset({LIMITS}), None)
    assert state.negotiated == negotiated
    assert state.negotiated.resource_limits
    assert not state.negotiated.dual_websocket
    assert state.events_received() == [HandshakeComplete(negotiated)]
    assert not state.ended


def test_ready_grants_only_what_both_sides_know() -> None:
    state = HostProtocol()
    state.receive(hello("zz-unknown", DUAL, LIMITS))
    # dual-websocket-v1 is not a default capability (stdio); unknown optional ones are ignored.
    assert sent_after_handshake(state) == [ConnectionReady(1, (LIMITS,))]


def test_ready_without_capabilities() -> None:
    state = HostProtocol()
    state.receive(ConnectionHello((1,), (), ()))
    assert sent_after_handshake(state) == [ConnectionReady(1, ())]
    assert state.negotiated is not None
    assert not state.negotiated.resource_limits


def test_required_limits_are_granted() -> None:
    state = HostProtocol()
    state.receive(hello(required=(LIMITS,)))
    assert sent_after_handshake(state) == [ConnectionReady(1, (LIMITS,))]


def test_bulk_token_only_with_dual() -> None:
    tokens: list[str] = []

    def new_token() -> str:
        tokens.append(f"tok-{len(tokens)}")
        return tokens[-1]

    dual = HostProtocol(capabilities=(LIMITS, DUAL), new_token=new_token)
    dual.receive(hello(DUAL, LIMITS))
    assert dual.data_to_send()[0][1] is Lane.CONTROL  # the ready goes on the control socket
    assert dual.events_received() == [
        HandshakeComplete(Negotiated(frozenset({DUAL, LIMITS}), "tok-0"))
    ]
    assert dual.negotiated is not None
    assert dual.negotiated.dual_websocket
    assert dual.negotiated.bulk_connection_token == "tok-0"
    dual.receive(open_(1))
    dual.session_opened(1)
    assert frames(dual) == [(ok(1, SessionReady(S1)), Lane.CONTROL)]

    single = HostProtocol(capabilities=(LIMITS, DUAL), new_token=new_token)
    single.receive(hello(LIMITS))
    [reply] = sent_after_handshake(single)
    assert reply == ConnectionReady(1, (LIMITS,))
    assert isinstance(reply, ConnectionReady) and reply.bulk_connection_token is UNSET
    assert tokens == ["tok-0"]  # no token was minted for the single connection


def test_the_dual_ready_carries_the_token() -> None:
    state = HostProtocol(capabilities=(LIMITS, DUAL), new_token=lambda: "tok")
    state.receive(hello(DUAL, LIMITS))
    assert sent_after_handshake(state) == [ConnectionReady(1, (DUAL, LIMITS), "tok")]


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (OperationCancel(1), InvalidHello("first message must be connection/hello")),
        (open_(1), InvalidHello("first message must be connection/hello")),
        (delivered(1), InvalidHello("first message must be connection/hello")),
        (ConnectionHello((2, 3), (), ()), NoCompatibleVersion((1,))),
        (ConnectionHello((2,), ("nope",), ()), NoCompatibleVersion((1,))),
        (hello(required=("zeta", "alpha")), MissingRequiredCapability("alpha")),
        (hello(required=(DUAL,)), MissingRequiredCapability(DUAL)),
    ],
)
def test_rejections_end_the_connection_cleanly(first: ClientToHost, reason: Any) -> None:
    state = HostProtocol()
    assert exchange(state, first) == ([ConnectionEnded(None, ())], [ConnectionRejected(reason)])
    assert state.negotiated is None
    assert state.ended
    assert state.failure is None
    # The rejection is the last frame: nothing more is received.
    assert exchange(state, hello(LIMITS)) == ([], [])
    state.receive_data(encode_frame(hello(LIMITS)))
    assert out(state) == ([], [])


def test_invalid_hello_bytes() -> None:
    state = HostProtocol()
    state.receive(OperationCancel(1))
    [(frame, lane)] = state.data_to_send()
    assert lane is Lane.CONTROL
    assert bytes(frame[4:]) == (
        b'{"type":"connection/rejected","reason":{"type":"invalidHello",'
        b'"message":"first message must be connection/hello"}}'
    )


def test_second_hello_is_l3() -> None:
    state = host()
    state.receive(open_(1))
    assert state.events_received() == [OpenSession(1, S1, NO_LIMITS)]
    assert exchange(state, hello(LIMITS)) == ([ConnectionEnded(L3, (1,))], [])
    assert state.failure == L3
    assert state.ended


# -- lanes of a dual connection (§7.3) -------------------------------------------------------------


def test_dual_frames_travel_on_their_lanes() -> None:
    state = dual_host()
    state.receive(open_(1))
    state.session_opened(1)
    state.receive(execute(2))
    state.events_received()
    state.start_tool_call(S1, tool_call("1"))  # early: held until execution/started
    state.start_notification(S1, "call-1", CellId("1"), "hi")
    assert state.execution_started(2, CellId("1"))
    state.receive(delivered(2))
    assert state.events_received() == [resolved(2, NotificationAccepted())]
    state.revoke_callback(1)
    state.initial_response(2, result("1"))
    state.cell_closed(S1, CellId("1"))
    assert frames(state) == [
        (ok(1, SessionReady(S1)), Lane.CONTROL),
        (started(2, "1"), Lane.CONTROL),
        (delegated(1, wire_tool("1")), Lane.BULK),
        (delegated(2, wire_note("1")), Lane.CONTROL),
        (DelegateCancel(1), Lane.BULK),
        (initial(2, "1"), Lane.CONTROL),
        (cell_closed("1"), Lane.CONTROL),
    ]


def test_dual_answers_on_their_lanes_resolve_callbacks() -> None:
    state = dual_host()
    opened(state)
    finished_cell(state, 2, "1")
    assert call(state, "1")[0] == 1
    assert note(state, "1")[0] == 2
    assert call(state, "1")[0] == 3
    assert exchange(state, answer(1, [1, 2]), Lane.BULK) == (
        [resolved(1, ToolReturned([1, 2]))],
        [],
    )
    assert exchange(state, delivered(2), Lane.CONTROL) == (
        [resolved(2, NotificationAccepted())],
        [],
    )
    error = DelegateResponseMessage(3, WireError("tool failed"))
    assert exchange(state, error, Lane.BULK) == ([resolved(3, "tool failed")], [])
    assert exchange(state, OperationCancel(9), Lane.CONTROL) == ([], [])
    assert not state.ended


@pytest.mark.parametrize(
    ("message", "lane", "text"),
    [
        (open_(5, S2), Lane.BULK, "operation/request is not allowed on the bulk socket"),
        (OperationCancel(3), Lane.BULK, "operation/cancel is not allowed on the bulk socket"),
        (hello(LIMITS), Lane.BULK, "connection/hello is not allowed on the bulk socket"),
        (answer(1), Lane.CONTROL, "delegate/response is not allowed on the control socket"),
        (
            DelegateResponseMessage(1, WireError("no")),
            Lane.CONTROL,
            "delegate/response is not allowed on the control socket",
        ),
        (delivered(2), Lane.BULK, "delegate/response is not allowed on the bulk socket"),
    ],
)
def test_a_message_on_the_wrong_socket_is_l5(message: ClientToHost, lane: Lane, text: str) -> None:
    state = dual_host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    assert state.events_received() == [StartWait(3, S1, WaitRequest(CellId("1"), 100))]
    call(state, "1")
    note(state, "1")
    reason = f"code-mode message {text}"
    assert exchange(state, message, lane) == (
        [resolved(1, J4), resolved(2, J4), ConnectionEnded(reason, (3,))],
        [],
    )
    assert state.failure == reason


def test_a_single_connection_does_not_check_lanes() -> None:
    state = host()
    assert exchange(state, open_(1), Lane.BULK) == ([OpenSession(1, S1, NO_LIMITS)], [])
    state.session_opened(1)
    assert sent(state) == [ok(1, SessionReady(S1))]
    finished_cell(state, 2, "1")
    call(state, "1")
    note(state, "1")
    assert exchange(state, answer(1), Lane.CONTROL) == ([resolved(1, ToolReturned(None))], [])
    assert exchange(state, delivered(2), Lane.BULK) == ([resolved(2, NotificationAccepted())], [])
    state.revoke_callback(call(state, "1")[0])
    assert frames(state) == [(DelegateCancel(3), Lane.CONTROL)]


# -- bytes in (§6) ---------------------------------------------------------------------------------


def test_bytes_in_any_chunking() -> None:
    data = encode_frame(hello(LIMITS)) + encode_frame(open_(1)) + encode_frame(execute(2))
    whole = HostProtocol()
    whole.receive_data(bytes(data))
    expected: list[HostEvent] = [
        HandshakeComplete(Negotiated(frozenset({LIMITS}), None)),
        OpenSession(1, S1, NO_LIMITS),
        StartExecute(2, S1, EXECUTE),
    ]
    assert out(whole) == (expected, [ConnectionReady(1, (LIMITS,))])

    bytewise = HostProtocol()
    for index in range(len(data) - 1):
        bytewise.receive_data(memoryview(data)[index : index + 1])
    assert bytewise.events_received() == expected[:2]  # the last frame is one byte short
    bytewise.receive_data(bytearray(data[-1:]))
    assert bytewise.events_received() == expected[2:]
    assert sent(bytewise) == [ConnectionReady(1, (LIMITS,))]
    assert not bytewise.ended


def test_an_empty_chunk_is_nothing() -> None:
    state = HostProtocol()
    state.receive_data(b"")
    assert out(state) == ([], [])
    assert not state.ended


def test_receive_frame_takes_one_whole_frame() -> None:
    state = HostProtocol()
    state.receive_frame(encode_frame(hello(LIMITS)))
    assert sent_after_handshake(state) == [ConnectionReady(1, (LIMITS,))]
    state.receive_frame(bytes(encode_frame(open_(1))))
    assert out(state) == ([OpenSession(1, S1, NO_LIMITS)], [])


def _trailing(frame: bytearray) -> tuple[bytes, str]:
    length = len(frame) - 4
    return bytes(
        frame
    ) + b" ", f"code-mode IPC frame declares {length} payload bytes but contains {length + 1}"


def _truncated(frame: bytearray) -> tuple[bytes, str]:
    length = len(frame) - 4
    return bytes(
        frame[:-1]
    ), f"code-mode IPC frame declares {length} payload bytes but contains {length - 1}"


def _two_frames(frame: bytearray) -> tuple[bytes, str]:
    length = len(frame) - 4
    return bytes(frame) * 2, (
        f"code-mode IPC frame declares {length} payload bytes but contains {2 * length + 4}"
    )


def _no_prefix(frame: bytearray) -> tuple[bytes, str]:
    return bytes(frame[:3]), "code-mode IPC frame is missing its length prefix"


def _oversize(frame: bytearray) -> tuple[bytes, str]:
    return (MAX_FRAME_BYTES + 1).to_bytes(4, "little"), (
        f"code-mode IPC frame length {MAX_FRAME_BYTES + 1} {FRAME_LIMIT}"
    )


_BAD_BUFFERS = pytest.mark.parametrize(
    "damage",
    [_trailing, _truncated, _two_frames, _no_prefix, _oversize],
    ids=["trailing", "truncated", "two-frames", "no-prefix", "oversize"],
)


@_BAD_BUFFERS
def test_a_bad_message_buffer_before_the_hello_is_l1(damage: Any) -> None:
    state = HostProtocol()
    buffer, detail = damage(encode_frame(hello(LIMITS)))
    state.receive_frame(buffer)
    reason = f"failed to read code-mode client hello: {detail}"
    assert out(state) == ([ConnectionEnded(reason, ())], [])
    assert state.failure == reason


@_BAD_BUFFERS
def test_a_bad_message_buffer_after_the_hello_is_l2(damage: Any) -> None:
    state = host()
    state.receive(open_(1))
    state.events_received()
    buffer, detail = damage(encode_frame(open_(2, S2)))
    state.receive_frame(buffer)
    reason = f"failed to read code-mode client message: {detail}"
    assert out(state) == ([ConnectionEnded(reason, (1,))], [])


@pytest.mark.parametrize(
    "payload",
    [
        b"{",
        b'{"type":"connection/hello"}',
        b'{"type":"operation/cancel","id":1,"id":2}',
        b'"hello"',
    ],
    ids=["json", "message", "duplicate-key", "not-an-object"],
)
def test_decode_errors_are_l1_before_the_hello_and_l2_after(payload: bytes) -> None:
    detail = decode_error(payload)
    frame = len(payload).to_bytes(4, "little") + payload

    before = HostProtocol()
    before.receive_data(frame)
    assert out(before) == (
        [ConnectionEnded(f"failed to read code-mode client hello: {detail}")],
        [],
    )

    after = host()
    after.receive_data(frame + encode_frame(open_(1)))  # nothing after the bad frame is read
    assert out(after) == (
        [ConnectionEnded(f"failed to read code-mode client message: {detail}")],
        [],
    )


def test_an_oversize_prefix_is_refused_before_the_payload_arrives() -> None:
    state = host()
    state.receive_data((MAX_FRAME_BYTES + 1).to_bytes(4, "little"))
    reason = (
        "failed to read code-mode client message: "
        f"code-mode IPC frame length {MAX_FRAME_BYTES + 1} {FRAME_LIMIT}"
    )
    assert out(state) == ([ConnectionEnded(reason)], [])


def test_eof_at_a_frame_boundary_is_a_clean_end() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive_data(encode_frame(wait(3, "1")))
    state.events_received()
    call(state, "1")
    state.receive_eof()
    assert out(state) == ([resolved(1, J4), ConnectionEnded(None, (3,))], [])
    assert state.ended
    assert state.failure is None


def test_eof_before_the_hello_is_a_clean_end() -> None:
    state = HostProtocol()
    state.receive_eof()
    assert out(state) == ([ConnectionEnded(None)], [])
    assert state.negotiated is None


@pytest.mark.parametrize("cut", [2, 4, 9])
def test_eof_inside_a_frame_is_l2(cut: int) -> None:
    state = host()
    frame = encode_frame(open_(1))
    state.receive_data(frame[:cut])
    state.receive_eof()
    length = len(frame) - 4
    detail = (
        f"code-mode IPC frame length prefix truncated after {cut} bytes"
        if cut < 4
        else f"code-mode IPC frame payload truncated: declared {length} bytes, received {cut - 4}"
    )
    assert out(state) == (
        [ConnectionEnded(f"failed to read code-mode client message: {detail}")],
        [],
    )


def test_eof_of_the_bulk_socket_ends_the_connection() -> None:
    state = dual_host()
    frame = encode_frame(answer(9))
    state.receive_data(frame[:5], Lane.BULK)
    state.receive_eof(Lane.BULK)
    detail = f"declared {len(frame) - 4} bytes, received 1"
    reason = (
        f"failed to read code-mode client message: code-mode IPC frame payload truncated: {detail}"
    )
    assert out(state) == ([ConnectionEnded(reason)], [])
    # A clean end of the bulk socket ends the connection cleanly.
    state = dual_host()
    state.receive_eof(Lane.BULK)
    assert out(state) == ([ConnectionEnded(None)], [])


# -- what the glue reports about its I/O, and the end ----------------------------------------------


@pytest.mark.parametrize(
    ("greeted", "report", "reason"),
    [
        (False, lambda s: s.read_failed("reset"), "failed to read code-mode client hello: reset"),
        (True, lambda s: s.read_failed("reset"), "failed to read code-mode client message: reset"),
        (
            False,
            lambda s: s.write_failed("EPIPE"),
            "failed to write code-mode client message: EPIPE",
        ),
        (
            True,
            lambda s: s.write_failed("EPIPE"),
            "failed to write code-mode client message: EPIPE",
        ),
        (True, HostProtocol.text_received, "code-mode client sent a text WebSocket message"),
        (True, HostProtocol.bulk_not_established, "code-mode bulk connection was not established"),
        (False, HostProtocol.close, None),
        (True, HostProtocol.close, None),
    ],
    ids=[
        "read-before-hello",
        "read",
        "write-before-hello",
        "write",
        "text",
        "bulk",
        "close-before-hello",
        "close",
    ],
)
def test_io_failures_end_the_connection(greeted: bool, report: Any, reason: str | None) -> None:
    state = host() if greeted else HostProtocol()
    requests: tuple[int, ...] = ()
    if greeted:
        state.receive(open_(1))
        state.events_received()
        requests = (1,)
    report(state)
    assert out(state) == ([ConnectionEnded(reason, requests)], [])
    assert state.failure == reason
    assert state.ended


def test_the_first_failure_wins() -> None:
    state = host()
    state.read_failed("reset")
    state.write_failed("EPIPE")
    state.text_received()
    state.bulk_not_established()
    state.close()
    state.receive_eof()
    assert out(state) == ([ConnectionEnded("failed to read code-mode client message: reset")], [])
    assert state.failure == "failed to read code-mode client message: reset"


def test_the_end_returns_in_flight_requests_and_resolves_callbacks() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    admitted(state, 3, "2")
    state.receive(wait(4, "1"))
    state.receive(open_(5, S2))
    state.receive(execute(6))
    state.events_received()
    first = call(state, "1")[0]
    second = note(state, "2")[0]
    early = call(state, "3")[0]  # held for execute 6
    state.session_opened(5)  # queued before the end: still to be written
    state.close()
    assert out(state) == (
        [
            resolved(first, J4),
            resolved(second, J4),
            resolved(early, J4),
            ConnectionEnded(None, (3, 4, 6)),
        ],
        [ok(5, SessionReady(S2))],
    )
    assert state.pending_callbacks == 0
    for request_id in (3, 4, 5, 6):
        assert not state.in_flight(request_id)
    # Nothing is received any more (not even answered H4).
    assert exchange(state, open_(7, "session-3")) == ([], [])
    state.receive_data(encode_frame(shutdown(8)))
    state.receive_frame(encode_frame(shutdown(9)))
    state.receive_eof()
    assert out(state) == ([], [])
    # Reports that arrive after the end answer nothing.
    assert state.execution_started(6, CellId("3")) is False
    state.wait_completed(4, LiveCell(Yielded(CellId("1"), [])))
    state.initial_response(3, result("2"))
    state.operation_failed(3, "late")
    state.revoke_callback(first)
    state.session_opened(5)
    assert out(state) == ([], [])
    # Callbacks started after the end fail at once with J4.
    assert call(state, "1") == (4, [resolved(4, J4)], [])
    assert note(state, "1") == (5, [resolved(5, J4)], [])
    assert state.pending_callbacks == 0


# -- request ids (§8.1) --------------------------------------------------------------------------


def test_duplicate_in_flight_request_id_is_l4() -> None:
    state = host()
    state.receive(open_(7))
    state.events_received()
    assert exchange(state, open_(7, S2)) == (
        [ConnectionEnded("duplicate code-mode request ID 7", (7,))],
        [],
    )
    assert state.failure == "duplicate code-mode request ID 7"


@pytest.mark.parametrize("request_id", [0, -5, 2**63 - 1, -(2**63)])
def test_any_i64_is_a_request_id_and_finished_ids_stay_taken(request_id: int) -> None:
    state = host()
    assert exchange(state, open_(request_id)) == ([OpenSession(request_id, S1, NO_LIMITS)], [])
    assert state.in_flight(request_id)
    state.session_opened(request_id)
    assert not state.in_flight(request_id)
    state.data_to_send()
    reason = f"duplicate code-mode request ID {request_id}"
    assert exchange(state, shutdown(request_id)) == ([ConnectionEnded(reason)], [])


def test_refused_request_ids_count_as_finished() -> None:
    state = host()
    assert exchange(state, shutdown(3, "nope")) == (
        [],
        refused(3, "unknown code-mode session nope"),
    )
    assert exchange(state, open_(3)) == ([ConnectionEnded("duplicate code-mode request ID 3")], [])


def test_the_last_4096_finished_ids_are_remembered() -> None:
    state = host()
    for request_id in range(1, RECENT_ID_MEMORY + 1):  # 4096 refused, so finished, ids
        state.receive(shutdown(request_id, "x"))
    state.data_to_send()
    assert exchange(state, open_(1)) == ([ConnectionEnded("duplicate code-mode request ID 1")], [])
    # One more finished id pushes id 1 out of the memory: it is accepted again.
    state = host()
    for request_id in range(1, RECENT_ID_MEMORY + 2):
        state.receive(shutdown(request_id, "x"))
    state.data_to_send()
    assert exchange(state, open_(1)) == ([OpenSession(1, S1, NO_LIMITS)], [])
    assert exchange(state, open_(2, S2)) == (
        [ConnectionEnded("duplicate code-mode request ID 2", (1,))],
        [],
    )


# -- H2: in-flight requests ----------------------------------------------------------------------


def test_too_many_in_flight_requests_is_h2_and_the_id_counts_as_finished() -> None:
    state = host(max_in_flight_requests=2)
    state.receive(open_(1))
    state.receive(open_(2, S2))
    state.events_received()
    assert exchange(state, open_(3, "session-3")) == ([], refused(3, H2))
    # H2 comes before every method check (here: an unknown session).
    assert exchange(state, shutdown(4, "unknown")) == ([], refused(4, H2))
    # Capacity returns when a request finishes; the refused session id was never opened.
    state.session_opened(1)
    state.data_to_send()
    assert exchange(state, open_(5, "session-3")) == ([OpenSession(5, "session-3", NO_LIMITS)], [])
    assert exchange(state, open_(3, "session-4")) == (
        [ConnectionEnded("duplicate code-mode request ID 3", (2, 5))],
        [],
    )


def test_duplicate_id_is_checked_before_h2() -> None:
    state = host(max_in_flight_requests=1)
    state.receive(open_(1))
    state.events_received()
    assert exchange(state, open_(1)) == (
        [ConnectionEnded("duplicate code-mode request ID 1", (1,))],
        [],
    )


def test_an_admitted_execute_is_in_flight_until_its_initial_response() -> None:
    state = host(max_in_flight_requests=2)
    opened(state)
    admitted(state, 2, "1")
    admitted(state, 3, "2")
    assert exchange(state, wait(4, "1")) == ([], refused(4, H2))
    state.initial_response(2, result("1"))
    assert sent(state) == [initial(2, "1")]
    assert not state.in_flight(2)
    assert exchange(state, wait(5, "2")) == ([StartWait(5, S1, WaitRequest(CellId("2"), 100))], [])


# -- H3: active cells ----------------------------------------------------------------------------


def test_too_many_active_cells_is_h3_counting_pending_admissions() -> None:
    state = host(max_active_cells=1)
    opened(state)
    assert exchange(state, execute(2)) == ([StartExecute(2, S1, EXECUTE)], [])
    # The pending admission takes the only slot.
    assert exchange(state, execute(3)) == ([], refused(3, H3))
    assert state.execution_started(2, CellId("1"))
    assert sent(state) == [started(2, "1")]
    assert state.active_cells == 1
    assert exchange(state, execute(4)) == ([], refused(4, H3))
    # The runtime retires the cell, but cell/closed waits for the initial response: still active.
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == []
    assert state.active_cells == 1
    assert exchange(state, execute(5)) == ([], refused(5, H3))
    state.initial_response(2, result("1"))
    assert sent(state) == [initial(2, "1"), cell_closed("1")]
    assert state.active_cells == 0
    assert exchange(state, execute(6)) == ([StartExecute(6, S1, EXECUTE)], [])


def test_a_failed_or_cancelled_admission_frees_its_slot() -> None:
    state = host(max_active_cells=1)
    opened(state)
    state.receive(execute(2))
    state.events_received()
    state.operation_failed(2, "code mode session is shutting down")
    assert sent(state) == refused(2, "code mode session is shutting down")
    state.receive(execute(3))
    state.events_received()
    assert exchange(state, OperationCancel(3)) == ([CancelOperation(3)], [])
    assert state.execution_started(3, CellId("1")) is False
    assert sent(state) == refused(3, H1)  # the machine answered it
    assert state.active_cells == 0
    assert exchange(state, execute(4)) == ([StartExecute(4, S1, EXECUTE)], [])


def test_cells_of_every_session_count() -> None:
    state = host(max_active_cells=2)
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    assert exchange(state, execute(5, S1)) == ([], refused(5, H3))
    state.cell_closed(S2, CellId("1"))
    assert sent(state) == [cell_closed("1", S2)]
    assert exchange(state, execute(6, S1)) == ([StartExecute(6, S1, EXECUTE)], [])


# -- H4: the host stops admitting ------------------------------------------------------------------


def test_stop_admitting_answers_later_requests_h4_and_running_work_goes_on() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.receive(execute(4))
    state.events_received()
    state.stop_admitting()
    assert out(state) == ([], [])
    for message in (open_(5, S2), execute(6), wait(7, "1"), terminate(8, "1"), shutdown(9)):
        assert exchange(state, message) == ([], refused(message.id, H4))
    # What was accepted before goes on.
    assert state.execution_started(4, CellId("2"))
    assert sent(state) == [started(4, "2")]
    state.wait_completed(3, LiveCell(Yielded(CellId("1"), [])))
    assert len(sent(state)) == 1
    assert call(state, "1")[0] == 1
    assert exchange(state, answer(1)) == ([resolved(1, ToolReturned(None))], [])
    assert exchange(state, OperationCancel(4)) == ([], [])  # admitted: not cancellable
    # H4 ids count as finished.
    assert exchange(state, open_(5, S2)) == (
        [ConnectionEnded("duplicate code-mode request ID 5", (4,))],
        [],
    )


def test_h2_is_checked_before_h4() -> None:
    state = host(max_in_flight_requests=1)
    state.receive(open_(1))
    state.events_received()
    state.stop_admitting()
    assert exchange(state, open_(2, S2)) == ([], refused(2, H2))
    state.session_opened(1)
    state.data_to_send()
    assert exchange(state, open_(3, S2)) == ([], refused(3, H4))


def test_duplicate_ids_are_checked_before_h4() -> None:
    state = host()
    state.receive(open_(1))
    state.events_received()
    state.stop_admitting()
    assert exchange(state, open_(1, S2)) == (
        [ConnectionEnded("duplicate code-mode request ID 1", (1,))],
        [],
    )


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
    assert exchange(state, make(2, " odd id ")) == (
        [],
        refused(2, "unknown code-mode session  odd id "),
    )
    # Once shutdown began, the session is unknown to new requests.
    assert exchange(state, shutdown(3)) == ([StartShutdown(3, S1)], [])
    assert exchange(state, make(4, S1)) == ([], refused(4, "unknown code-mode session session-1"))
    # And after it finished.
    state.session_shut_down(3)
    assert sent(state) == [ok(3, SessionClosed(S1))]
    assert exchange(state, make(5, S1)) == ([], refused(5, "unknown code-mode session session-1"))


def test_operations_behind_a_failed_open_are_answered_h5() -> None:
    state = host()
    state.receive(open_(1))
    # Pipelined behind the open: accepted (the glue waits for the open's outcome).
    state.receive(execute(2))
    state.receive(wait(3, "1"))
    state.receive(shutdown(4))
    assert state.events_received() == [
        OpenSession(1, S1, NO_LIMITS),
        StartExecute(2, S1, EXECUTE),
        StartWait(3, S1, WaitRequest(CellId("1"), 100)),
        StartShutdown(4, S1),
    ]
    failure = (
        "invalid code-mode session execution limits: max_heap_size_bytes must be greater than 0"
    )
    state.operation_failed(1, failure)
    assert sent(state) == refused(1, failure)
    # The failed open forgets the session.
    assert exchange(state, wait(5, "1")) == ([], refused(5, "unknown code-mode session session-1"))
    state.session_unavailable(2)
    state.session_unavailable(3)
    # Every request gets exactly one answer: the pipelined shutdown too.
    state.session_shut_down(4)
    h5 = "unknown code-mode session session-1"
    assert sent(state) == refused(2, h5) + refused(3, h5) + refused(4, h5)
    for request_id in (1, 2, 3, 4):
        assert not state.in_flight(request_id)
    state.session_unavailable(2)
    state.session_shut_down(4)
    assert sent(state) == []


def test_an_execute_behind_a_failed_open_gives_its_admission_slot_back() -> None:
    state = host(max_active_cells=1)
    state.receive(open_(1))
    state.receive(execute(2))
    state.events_received()
    state.operation_failed(1, "boom")
    state.session_unavailable(2)
    state.data_to_send()
    opened(state, 3, S2)
    assert exchange(state, execute(4, S2)) == ([StartExecute(4, S2, EXECUTE)], [])


def test_a_failed_open_forgets_the_session() -> None:
    state = host()
    state.receive(open_(1))
    state.events_received()
    state.operation_failed(1, "boom")
    assert sent(state) == refused(1, "boom")
    assert not state.in_flight(1)
    assert exchange(state, execute(2)) == ([], refused(2, "unknown code-mode session session-1"))
    assert exchange(state, shutdown(3)) == ([], refused(3, "unknown code-mode session session-1"))


# -- H6: conversion failures ---------------------------------------------------------------------


def test_negative_max_output_tokens_is_h6() -> None:
    state = host()
    opened(state)
    assert exchange(state, execute(2, max_output_tokens=-1)) == (
        [],
        refused(2, f"invalid code-mode execute request: {X1}"),
    )
    assert not state.in_flight(2)
    # Conversion is checked before the session is looked up (§8.2, session/execute).
    assert exchange(state, execute(3, "nope", max_output_tokens=-(2**31))) == (
        [],
        refused(3, f"invalid code-mode execute request: {X1}"),
    )
    # Zero and null are fine.
    assert exchange(state, execute(4, max_output_tokens=0)) == (
        [StartExecute(4, S1, ExecuteRequest("call-1", "text('x')", [], 5000, 0))],
        [],
    )
    assert exchange(state, execute(5, max_output_tokens=None)) == (
        [StartExecute(5, S1, ExecuteRequest("call-1", "text('x')", [], 5000, None))],
        [],
    )


# -- session/open: H9, H10, H11 ------------------------------------------------------------------


def test_open_converts_limits() -> None:
    state = host()
    limits = WireSessionCellExecutionLimits(max_yield_time_ms=250)
    assert exchange(state, open_(1, S1, limits)) == (
        [OpenSession(1, S1, CodeModeSessionCellExecutionLimits(250, None))],
        [],
    )
    assert exchange(state, open_(2, S2, WireSessionCellExecutionLimits())) == (
        [OpenSession(2, S2, NO_LIMITS)],
        [],
    )
    big = WireSessionCellExecutionLimits(2**64 - 1, 2**64 - 1)
    assert exchange(state, open_(3, "s3", big)) == (
        [OpenSession(3, "s3", CodeModeSessionCellExecutionLimits(2**64 - 1, 2**64 - 1))],
        [],
    )


@pytest.mark.parametrize(
    "limits", [WireSessionCellExecutionLimits(), WireSessionCellExecutionLimits(1, 2)]
)
def test_limits_without_the_capability_are_h9(limits: WireSessionCellExecutionLimits) -> None:
    state = HostProtocol()
    state.receive(ConnectionHello((1,), (), ()))
    state.events_received()
    state.data_to_send()
    assert exchange(state, open_(1, S1, limits)) == ([], refused(1, H9))
    # Nothing was opened: the id is still free, and a plain open works.
    assert exchange(state, open_(2)) == ([OpenSession(2, S1, NO_LIMITS)], [])
    # H9 comes before H10.
    assert exchange(state, open_(3, S1, limits)) == ([], refused(3, H9))


def test_limits_are_h9_when_the_host_does_not_offer_the_capability() -> None:
    state = HostProtocol(capabilities=())
    state.receive(hello(LIMITS))
    assert sent_after_handshake(state) == [ConnectionReady(1, ())]
    assert exchange(state, open_(1, S1, WireSessionCellExecutionLimits())) == ([], refused(1, H9))


def test_open_twice_is_h10() -> None:
    state = host()
    state.receive(open_(1))
    state.events_received()
    h10 = "code-mode session ID `session-1` is already open"
    assert exchange(state, open_(2)) == ([], refused(2, h10))  # the first open is still running
    state.session_opened(1)
    state.data_to_send()
    assert exchange(state, open_(3)) == ([], refused(3, h10))


def test_reopen_after_shutdown_is_h11() -> None:
    state = host()
    opened(state)
    h11 = "code-mode session ID `session-1` was reused"
    state.receive(shutdown(2))
    state.events_received()
    # Shutdown began: the id is refused as reused.
    assert exchange(state, open_(3)) == ([], refused(3, h11))
    state.session_shut_down(2)
    state.data_to_send()
    assert exchange(state, open_(4)) == ([], refused(4, h11))


def test_the_last_4096_session_ids_are_remembered() -> None:
    state = host()
    opened(state, 1, "s0")
    state.receive(shutdown(2, "s0"))
    state.session_shut_down(2)
    out(state)
    request_id = 3
    for index in range(1, RECENT_ID_MEMORY):  # 4095 more opened ids
        state.receive(open_(request_id, f"s{index}"))
        state.session_opened(request_id)
        request_id += 1
    out(state)
    assert exchange(state, open_(request_id, "s0")) == (
        [],
        refused(request_id, "code-mode session ID `s0` was reused"),
    )
    opened(state, request_id + 1, f"s{RECENT_ID_MEMORY}")
    assert exchange(state, open_(request_id + 2, "s0")) == (
        [OpenSession(request_id + 2, "s0", NO_LIMITS)],
        [],
    )


# -- operation/cancel (§8.5) ---------------------------------------------------------------------


def test_cancel_before_admission() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.events_received()
    assert exchange(state, OperationCancel(2)) == ([CancelOperation(2)], [])
    assert state.cancelled(2)
    assert exchange(state, OperationCancel(2)) == ([], [])  # once
    # The runtime admitted it anyway: the machine answers H1, the glue must abandon the cell.
    assert state.execution_started(2, CellId("1")) is False
    assert sent(state) == refused(2, H1)
    assert not state.in_flight(2)
    assert not state.cancelled(2)
    # Late reports for the id are ignored; the abandoned cell is never announced.
    state.initial_response(2, result("1"))
    state.operation_cancelled(2)
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == []
    assert state.active_cells == 0
    state.receive(shutdown(3))
    state.events_received()
    state.session_shut_down(3)
    assert sent(state) == [ok(3, SessionClosed(S1))]


def test_cancel_reported_by_the_glue_is_h1() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.receive(OperationCancel(2))
    assert state.events_received() == [StartExecute(2, S1, EXECUTE), CancelOperation(2)]
    # The glue stopped the admission before the runtime admitted anything.
    state.operation_cancelled(2)
    assert sent(state) == refused(2, H1)
    assert state.execution_started(2, CellId("1")) is False
    assert sent(state) == []


def test_cancel_of_an_execute_that_fails_to_be_admitted() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.receive(OperationCancel(2))
    state.events_received()
    # The runtime refused it before the cancel took effect: its error is the one answer.
    state.operation_failed(2, "runtime refused")
    assert sent(state) == refused(2, "runtime refused")
    state.operation_cancelled(2)
    assert sent(state) == []


def test_cancel_after_admission_is_ignored() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    assert exchange(state, OperationCancel(2)) == ([], [])
    assert not state.cancelled(2)
    state.initial_response(2, result("1"))
    assert sent(state) == [initial(2, "1")]


def test_cancel_of_a_wait() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.events_received()
    assert exchange(state, OperationCancel(3)) == ([CancelOperation(3)], [])
    assert state.cancelled(3)
    assert exchange(state, OperationCancel(3)) == ([], [])
    state.operation_cancelled(3)
    assert sent(state) == refused(3, H1)
    # The real outcome arrives late: ignored, the request was answered.
    state.wait_completed(3, LiveCell(Yielded(CellId("1"), [])))
    assert sent(state) == []


def test_a_wait_answered_before_its_cancel_took_effect() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.receive(OperationCancel(3))
    state.events_received()
    outcome = LiveCell(Yielded(CellId("1"), [InputText("late")]))
    body = WireRuntimeResponse(yielded=WireYielded("1", [WireInputText("late")]))
    state.wait_completed(3, outcome)
    assert sent(state) == [ok(3, WaitCompleted(WireWaitOutcome(live_cell=body)))]
    state.operation_cancelled(3)
    assert sent(state) == []


def test_ignored_cancels() -> None:
    state = host()
    state.receive(open_(1))
    state.events_received()
    assert exchange(state, OperationCancel(1)) == ([], [])  # open
    state.session_opened(1)
    state.data_to_send()
    finished_cell(state, 2, "1")
    assert exchange(state, OperationCancel(2)) == ([], [])  # finished execute
    state.receive(terminate(3, "1"))
    state.events_received()
    assert exchange(state, OperationCancel(3)) == ([], [])  # terminate
    state.receive(shutdown(4))
    state.events_received()
    assert exchange(state, OperationCancel(4)) == ([], [])  # shutdown
    assert exchange(state, OperationCancel(99)) == ([], [])  # never seen
    assert exchange(state, OperationCancel(1)) == ([], [])  # finished open
    for request_id in (1, 2, 3, 4, 99):
        assert not state.cancelled(request_id)


# -- execute, wait, terminate answers ------------------------------------------------------------


def test_execute_two_phases() -> None:
    state = host()
    opened(state)
    assert exchange(state, execute(2)) == ([StartExecute(2, S1, EXECUTE)], [])
    assert state.execution_started(2, CellId("g2:42")) is True
    assert sent(state) == [started(2, "g2:42")]
    assert state.in_flight(2)
    state.initial_response(2, result("g2:42", "pong"))
    assert sent(state) == [initial(2, "g2:42", "pong")]
    assert not state.in_flight(2)
    state.initial_response(2, result("g2:42"))
    assert state.execution_started(2, CellId("g2:42")) is False
    assert sent(state) == []


def test_initial_response_errors() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    state.operation_failed(2, "exec runtime ended unexpectedly")
    assert sent(state) == [ExecuteInitialResponse(2, WireError("exec runtime ended unexpectedly"))]
    admitted(state, 3, "2")
    state.operation_crashed(3, RuntimeError("boom"))
    assert sent(state) == [
        ExecuteInitialResponse(3, WireError("code-mode host internal error: RuntimeError: boom"))
    ]


def test_a_crashed_operation_is_answered() -> None:
    state = host()
    state.receive(open_(1))
    state.events_received()
    state.operation_crashed(1, KeyError("x"))
    assert sent(state) == refused(1, "code-mode host internal error: KeyError: 'x'")
    assert exchange(state, execute(2)) == ([], refused(2, "unknown code-mode session session-1"))


def test_execute_refused_by_the_runtime_has_no_initial_response() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.events_received()
    state.operation_failed(2, "code mode session is shutting down")
    assert sent(state) == refused(2, "code mode session is shutting down")
    state.initial_response(2, result("1"))
    assert sent(state) == []


def test_wait_and_terminate_answers() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    assert exchange(state, wait(3, "1", yield_ms=2**64 - 1)) == (
        [StartWait(3, S1, WaitRequest(CellId("1"), 2**64 - 1))],
        [],
    )
    assert exchange(state, terminate(4, "7")) == ([StartTerminate(4, S1, CellId("7"))], [])
    live = LiveCell(Terminated(CellId("1"), [InputText("t")]))
    body = WireRuntimeResponse(terminated=WireTerminated("1", [WireInputText("t")]))
    state.wait_completed(3, live)
    assert sent(state) == [ok(3, WaitCompleted(WireWaitOutcome(live_cell=body)))]
    missing = MissingCell(Result(CellId("7"), [], "exec cell 7 not found"))
    missing_body = WireRuntimeResponse(result=WireResultBody("7", [], "exec cell 7 not found"))
    state.wait_completed(4, missing)
    assert sent(state) == [ok(4, WaitCompleted(WireWaitOutcome(missing_cell=missing_body)))]
    state.receive(wait(5, "1"))
    state.events_received()
    state.operation_failed(5, "exec cell 1 already has an active observer")
    assert sent(state) == refused(5, "exec cell 1 already has an active observer")


def test_open_and_shutdown_answers() -> None:
    state = host()
    state.receive(open_(1, " s "))
    state.events_received()
    state.session_opened(1)
    assert sent(state) == [ok(1, SessionReady(" s "))]
    state.session_opened(1)
    assert sent(state) == []
    assert exchange(state, shutdown(2, " s ")) == ([StartShutdown(2, " s ")], [])
    state.session_shut_down(2)
    assert sent(state) == [ok(2, SessionClosed(" s "))]
    state.session_shut_down(2)
    assert sent(state) == []


# -- timing of the latest wire revision ----------------------------------------------------------


def test_latest_measures_the_host_duration_from_arrival_to_answer() -> None:
    clock = FakeClock(1_000)
    state = host(wire_revision="latest", clock=clock)
    assert state.wire_revision is WireRevision.LATEST
    opened(state)
    admitted(state, 2, "9")
    state.initial_response(2, Yielded(CellId("9"), []))  # the clock stood still
    assert sent(state) == [
        ExecuteInitialResponse(2, WireOk(WireRuntimeResponse(yielded=WireYielded("9", [], 0))))
    ]
    clock.now = 10_000
    state.receive(execute(3))
    state.events_received()
    clock.now = 12_000
    assert state.execution_started(3, CellId("1"))
    assert sent(state) == [started(3, "1")]
    clock.now = 15_500
    # A duration the response carries is replaced; a buffered time is kept (0 when absent).
    response = Result(CellId("1"), [], None, host_duration_ns=1, result_buffered_for_ns=7)
    state.initial_response(3, response)
    assert sent(state) == [
        ExecuteInitialResponse(
            3, WireOk(WireRuntimeResponse(result=WireResultBody("1", [], None, 7, 5_500)))
        )
    ]
    clock.now = 20_000
    state.receive(wait(4, "9"))
    state.receive(terminate(5, "2"))
    state.events_received()
    clock.now = 20_250
    state.wait_completed(4, LiveCell(Yielded(CellId("9"), [], host_duration_ns=999)))
    clock.now = 30_000
    state.wait_completed(5, MissingCell(Result(CellId("2"), [], "exec cell 2 not found")))
    assert sent(state) == [
        ok(
            4,
            WaitCompleted(
                WireWaitOutcome(live_cell=WireRuntimeResponse(yielded=WireYielded("9", [], 250)))
            ),
        ),
        ok(
            5,
            WaitCompleted(
                WireWaitOutcome(
                    missing_cell=WireRuntimeResponse(
                        result=WireResultBody("2", [], "exec cell 2 not found", 0, 10_000)
                    )
                )
            ),
        ),
    ]
    clock.now = 40_000
    state.receive(terminate(6, "9"))
    state.events_received()
    clock.now = 40_003
    state.wait_completed(6, LiveCell(Terminated(CellId("9"), [])))
    assert sent(state) == [
        ok(
            6,
            WaitCompleted(
                WireWaitOutcome(
                    live_cell=WireRuntimeResponse(terminated=WireTerminated("9", [], 3))
                )
            ),
        )
    ]


@pytest.mark.parametrize(
    ("offered", "revision"),
    [
        ((LIMITS,), WireRevision.PINNED),  # what upstream 0.149 offers
        ((), WireRevision.PINNED),
        ((LIMITS, "dual-websocket-v1"), WireRevision.PINNED),
        ((LIMITS, "yield-observation", "bounded-output-v1"), WireRevision.LATEST),  # 0.171
        (("some-future-capability",), WireRevision.LATEST),
    ],
)
def test_auto_takes_the_revision_from_the_hello(
    offered: tuple[str, ...], revision: WireRevision
) -> None:
    state = HostProtocol(wire_revision="auto", clock=FakeClock(0))
    before = state.wire_revision
    assert before is WireRevision.PINNED  # until the hello says otherwise
    _, messages = exchange(state, hello(*offered))
    assert isinstance(messages[0], ConnectionReady)
    # Capabilities the host does not know are still not granted.
    assert set(messages[0].capabilities) <= {LIMITS}
    assert state.wire_revision is revision
    opened(state)
    admitted(state, 2, "1")
    state.initial_response(2, Yielded(CellId("1"), []))
    timing = 0 if revision is WireRevision.LATEST else UNSET
    assert sent(state) == [
        ExecuteInitialResponse(2, WireOk(WireRuntimeResponse(yielded=WireYielded("1", [], timing))))
    ]


def test_the_pinned_revision_writes_no_timing_and_reads_no_clock() -> None:
    state = host(clock=no_clock)
    assert state.wire_revision is WireRevision.PINNED
    opened(state)
    admitted(state, 2, "1")
    state.initial_response(
        2, Result(CellId("1"), [], None, host_duration_ns=5, result_buffered_for_ns=6)
    )
    state.receive(wait(3, "1"))
    state.events_received()
    state.wait_completed(3, MissingCell(Result(CellId("1"), [], "gone", host_duration_ns=5)))
    # The pinned decoder in ``frames`` refuses any timing field.
    assert sent(state) == [
        ExecuteInitialResponse(
            2, WireOk(WireRuntimeResponse(result=WireResultBody("1", [], None)))
        ),
        ok(
            3,
            WaitCompleted(
                WireWaitOutcome(
                    missing_cell=WireRuntimeResponse(result=WireResultBody("1", [], "gone"))
                )
            ),
        ),
    ]


# -- answers too large for a frame: H8, J5 --------------------------------------------------------


def _too_large(message: HostToClient) -> str:
    return f"code-mode IPC frame length {len(encode_payload(message))} {FRAME_LIMIT}"


@pytest.mark.slow
def test_an_oversize_operation_response_is_h8() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.events_received()
    state.cell_closed(S1, CellId("1"))  # held by the wait's answer
    assert sent(state) == []
    outcome = LiveCell(Yielded(CellId("1"), [InputText("x" * MAX_FRAME_BYTES)]))
    detail = _too_large(ok(3, WaitCompleted(wait_outcome_to_wire(outcome))))
    state.wait_completed(3, outcome)
    assert sent(state) == [
        *refused(3, f"code-mode host response exceeds the IPC frame limit: {detail}"),
        cell_closed("1"),
    ]
    assert not state.in_flight(3)
    assert not state.ended


@pytest.mark.slow
def test_an_oversize_initial_response_is_h8() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    state.cell_closed(S1, CellId("1"))  # held by the initial response
    assert sent(state) == []
    response = Result(CellId("1"), [InputText("x" * MAX_FRAME_BYTES)], None)
    detail = _too_large(ExecuteInitialResponse(2, WireOk(wire_result("1", "x" * MAX_FRAME_BYTES))))
    state.initial_response(2, response)
    h8 = f"code-mode host response exceeds the IPC frame limit: {detail}"
    assert sent(state) == [ExecuteInitialResponse(2, WireError(h8)), cell_closed("1")]
    assert state.active_cells == 0
    assert not state.ended


@pytest.mark.slow
def test_an_oversize_tool_call_fails_with_j5() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    invocation = tool_call("1", "x" * MAX_FRAME_BYTES)
    wire = delegated(1, ToolInvoke(nested_tool_call_to_wire(invocation)))
    detail = _too_large(wire)
    assert state.start_tool_call(S1, invocation) == 1
    # J5 as both upstream releases give it: the frame's own error text (docs/interop.md).
    assert out(state) == ([resolved(1, detail)], [])
    assert state.pending_callbacks == 0
    # Nothing was sent or held: the cell closes at once, the next id is fresh, an answer is L6.
    assert call(state, "1") == (2, [], [delegated(2, wire_tool("1"))])
    state.revoke_callback(2)
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [DelegateCancel(2), cell_closed("1")]
    # Callback 2 is still in its grace: the end of the connection ends it too.
    assert exchange(state, answer(1)) == (
        [
            resolved(2, J4),
            ConnectionEnded("code-mode client returned unknown delegate request ID 1"),
        ],
        [],
    )


def test_a_callback_value_encoded_elsewhere_is_written_as_it_is() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    encoded = msgspec.Raw(b'{"v":"\\\\"}')  # a tool input encoded a piece at a time
    invocation = replace(tool_call("1"), input=encoded)
    assert state.start_tool_call(S1, invocation) == 1
    assert state.start_notification(S1, "call-1", CellId("1"), cast(str, msgspec.Raw(b'"n"'))) == 2
    payloads = [bytes(frame)[4:] for frame, _ in state.data_to_send()]
    assert payloads == [
        encode_payload(delegated(1, replace_input(wire_tool("1"), {"v": "\\"}))),
        encode_payload(delegated(2, wire_note("1", "n"))),
    ]


def replace_input(body: ToolInvoke, value: Any) -> ToolInvoke:
    return ToolInvoke(msgspec.structs.replace(body.invocation, input=value))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tool call", "notification"])
def test_a_callback_measured_too_large_elsewhere_is_j5_with_its_frame_length(kind: str) -> None:
    # The glue measured the value (it is longer than a frame) and kept none of it: a one-byte
    # stand-in and the bytes it lacks give the length the whole frame would have had.
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    long = "x" * MAX_FRAME_BYTES
    if kind == "tool call":
        whole = delegated(1, replace_input(wire_tool("1"), long))
        stand_in = replace(tool_call("1"), input=msgspec.Raw(b"0"))
        assert state.start_tool_call(S1, stand_in, excess=len(long) + 2 - 1) == 1
    else:
        whole = delegated(1, wire_note("1", long))
        text = cast(str, msgspec.Raw(b"0"))
        assert state.start_notification(S1, "call-1", CellId("1"), text, excess=len(long) + 1) == 1
    assert out(state) == ([resolved(1, _too_large(whole))], [])
    assert state.pending_callbacks == 0
    assert call(state, "1") == (2, [], [delegated(2, wire_tool("1"))])


# -- callbacks (§8.6) ----------------------------------------------------------------------------


def test_callback_ids_count_up_across_sessions_and_answers_resolve_them() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    assert call(state, "1") == (1, [], [delegated(1, wire_tool("1"))])
    assert note(state, "1", S2) == (2, [], [delegated(2, wire_note("1"), S2)])
    assert call(state, "1") == (3, [], [delegated(3, wire_tool("1"))])
    assert state.pending_callbacks == 3
    assert exchange(state, delivered(2)) == ([resolved(2, NotificationAccepted())], [])
    error = DelegateResponseMessage(1, WireError("tool failed"))
    assert exchange(state, error) == ([resolved(1, "tool failed")], [])
    assert state.pending_callbacks == 1
    assert exchange(state, answer(3, {"a": [1, None]})) == (
        [resolved(3, ToolReturned({"a": [1, None]}))],
        [],
    )
    assert call(state, "1")[0] == 4  # ids are never reused


def test_a_notification_error_answer_fails_it() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    note(state, "1")
    error = DelegateResponseMessage(1, WireError("no"))
    assert exchange(state, error) == ([resolved(1, "no")], [])


def test_a_tool_call_answered_as_a_notification_is_j2() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    call(state, "1")
    assert exchange(state, delivered(1)) == ([resolved(1, J2)], [])
    assert state.pending_callbacks == 0
    assert not state.ended


def test_a_notification_answered_as_a_tool_call_is_j3() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    note(state, "1")
    assert exchange(state, answer(1, "ok")) == ([resolved(1, J3)], [])
    assert state.pending_callbacks == 0
    assert not state.ended


def test_the_pending_callback_cap_is_1024() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    for expected in range(1, MAX_PENDING_DELEGATE_CALLS + 1):
        assert state.start_tool_call(S1, tool_call("1")) == expected
    assert len(sent(state)) == MAX_PENDING_DELEGATE_CALLS
    assert state.pending_callbacks == MAX_PENDING_DELEGATE_CALLS
    # Over the cap nothing is sent: tool calls and notifications fail with J1 (their ids are used).
    assert call(state, "1") == (1025, [resolved(1025, J1)], [])
    assert note(state, "1") == (1026, [resolved(1026, J1)], [])
    # Early callbacks of a cell being admitted count too.
    state.receive(execute(3))
    state.events_received()
    assert call(state, "2") == (1027, [resolved(1027, J1)], [])
    assert state.pending_callbacks == MAX_PENDING_DELEGATE_CALLS
    # Capacity returns as calls resolve: by an answer or a revocation.
    assert exchange(state, answer(5)) == ([resolved(5, ToolReturned(None))], [])
    assert call(state, "1") == (1028, [], [delegated(1028, wire_tool("1"))])
    assert call(state, "1") == (1029, [resolved(1029, J1)], [])
    state.revoke_callback(7)
    assert sent(state) == [DelegateCancel(7)]
    assert call(state, "1") == (1030, [], [delegated(1030, wire_tool("1"))])
    assert call(state, "1")[1] == [resolved(1031, J1)]
    # An id refused with J1 was never sent: an answer to it is L6.
    state.receive(answer(1025))
    assert state.failure == "code-mode client returned unknown delegate request ID 1025"
    events = state.events_received()
    # Every unresolved callback, and the one revoked (7) whose grace had not run out, ends J4.
    assert len(events) == MAX_PENDING_DELEGATE_CALLS + 2
    assert events[-1] == ConnectionEnded(state.failure, (3,))
    assert all(
        isinstance(event, CallbackResolved) and event.result == CallbackFailed(J4)
        for event in events[:-1]
    )


def test_a_session_cannot_take_the_slots_other_sessions_keep() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    greedy = MAX_PENDING_DELEGATE_CALLS - SESSION_CALLBACK_RESERVE
    for _ in range(greedy):
        state.start_tool_call(S1, tool_call("1"))
    assert len(sent(state)) == greedy
    # S1 reached what S2 leaves it: refused, while S2 still has its reserve.
    refused_id = greedy + 1
    assert call(state, "1") == (refused_id, [resolved(refused_id, J1)], [])
    for _ in range(SESSION_CALLBACK_RESERVE):
        state.start_tool_call(S2, tool_call("1"))
    assert len(sent(state)) == SESSION_CALLBACK_RESERVE
    assert state.pending_callbacks == MAX_PENDING_DELEGATE_CALLS
    last = MAX_PENDING_DELEGATE_CALLS + 1
    assert call(state, "1", S2) == (last + 1, [resolved(last + 1, J1)], [])
    # A slot S1 gives back is S1's again; S2's reserve is used, so S2 is not favoured.
    state.receive(answer(1))
    state.events_received()
    assert call(state, "1") == (last + 2, [], [delegated(last + 2, wire_tool("1"))])


def test_many_sessions_on_one_connection_keep_at_most_half_the_slots_in_reserve() -> None:
    # 17 sessions each keeping 64 slots would reserve all 1,024: no session could make a call.
    state = host()
    sessions = [f"session-{n}" for n in range(1, 21)]
    for n, session in enumerate(sessions, start=1):
        opened(state, n, session)
    finished_cell(state, 100, "1", S1)
    reserve = MAX_PENDING_DELEGATE_CALLS // (2 * len(sessions))
    allowed = MAX_PENDING_DELEGATE_CALLS - reserve * (len(sessions) - 1)
    assert allowed >= MAX_PENDING_DELEGATE_CALLS // 2
    for _ in range(allowed):
        state.start_tool_call(S1, tool_call("1"))
    assert len(sent(state)) == allowed
    refused_id = allowed + 1
    assert call(state, "1") == (refused_id, [resolved(refused_id, J1)], [])


def test_a_session_keeps_its_reserve_only_while_it_is_using_less() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    opened(state, 3, "session-3")
    finished_cell(state, 4, "1", S1)
    finished_cell(state, 5, "1", S2)
    # S2 uses 10 of its reserve, session-3 none: S1 may use everything but 54 + 64 slots.
    for _ in range(10):
        state.start_tool_call(S2, tool_call("1"))
    allowed = (
        MAX_PENDING_DELEGATE_CALLS - (SESSION_CALLBACK_RESERVE - 10) - SESSION_CALLBACK_RESERVE
    )
    for _ in range(allowed - 10):
        state.start_tool_call(S1, tool_call("1"))
    assert len(sent(state)) == allowed
    assert call(state, "1")[1] == [resolved(allowed + 1, J1)]
    # Session-3 shuts down: it keeps no reserve any more (its shutdown waits for nothing).
    state.receive(shutdown(6, "session-3"))
    state.events_received()
    state.session_shut_down(6)
    assert sent(state) == [ok(6, SessionClosed("session-3"))]
    for _ in range(SESSION_CALLBACK_RESERVE):
        assert call(state, "1")[1] == []
    assert call(state, "1")[1] != []


def test_a_shut_down_session_with_open_cells_keeps_no_reserve() -> None:
    state = host()
    opened(state, 1, S1)
    opened(state, 2, S2)
    finished_cell(state, 3, "1", S1)
    finished_cell(state, 4, "1", S2)
    state.receive(shutdown(5, S2))
    state.events_received()
    state.session_shut_down(5)  # session/closed waits for S2's cell
    assert sent(state) == []
    for _ in range(MAX_PENDING_DELEGATE_CALLS):
        state.start_tool_call(S1, tool_call("1"))
    assert len(sent(state)) == MAX_PENDING_DELEGATE_CALLS
    last = MAX_PENDING_DELEGATE_CALLS + 1
    assert call(state, "1") == (last, [resolved(last, J1)], [])


def test_early_callbacks_wait_for_execution_started() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.events_received()
    assert call(state, "1") == (1, [], [])
    assert note(state, "1") == (2, [], [])
    assert state.pending_callbacks == 2
    assert state.execution_started(2, CellId("1"))
    assert sent(state) == [
        started(2, "1"),
        delegated(1, wire_tool("1")),
        delegated(2, wire_note("1")),
    ]
    # Later callbacks go straight out.
    assert call(state, "1") == (3, [], [delegated(3, wire_tool("1"))])


def test_revoking_an_unsent_early_callback_sends_nothing() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.events_received()
    call(state, "1")
    note(state, "1")
    state.revoke_callback(1)
    assert out(state) == ([], [])
    assert state.pending_callbacks == 1
    assert state.execution_started(2, CellId("1"))
    assert sent(state) == [started(2, "1"), delegated(2, wire_note("1"))]
    assert exchange(state, answer(1)) == ([], [])  # a (bogus) answer for it is ignored


def test_early_callbacks_of_a_cancelled_execute_are_never_sent() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.events_received()
    call(state, "1")
    assert exchange(state, OperationCancel(2)) == ([CancelOperation(2)], [])
    assert state.execution_started(2, CellId("1")) is False
    assert sent(state) == refused(2, H1)
    # The glue abandons the cell: the runtime cancels the call, then retires the cell.
    state.revoke_callback(1)
    state.cell_closed(S1, CellId("1"))
    assert out(state) == ([], [])
    assert state.pending_callbacks == 0
    assert exchange(state, answer(1)) == ([], [])  # a (bogus) late answer for it is ignored
    state.receive(shutdown(3))
    state.events_received()
    state.session_shut_down(3)
    assert sent(state) == [ok(3, SessionClosed(S1))]


def test_an_abandoned_cell_with_held_callbacks_releases_them() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.receive(OperationCancel(2))
    state.events_received()
    call(state, "1")
    assert state.execution_started(2, CellId("1")) is False
    assert sent(state) == refused(2, H1)
    # The cell closes while its callback is still held: nothing is sent, the slot is released.
    state.receive(shutdown(3))
    state.events_received()
    state.session_shut_down(3)
    assert sent(state) == []  # the unannounced cell still holds the session
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [ok(3, SessionClosed(S1))]
    assert state.pending_callbacks == 0
    state.revoke_callback(1)
    assert out(state) == ([], [])


def test_revoke_sends_delegate_cancel_once() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    call(state, "1")
    state.revoke_callback(1)
    assert sent(state) == [DelegateCancel(1)]
    state.revoke_callback(1)
    assert sent(state) == []
    assert state.pending_callbacks == 0
    # An answer for a revoked id is ignored: its end is the glue's to decide.
    assert exchange(state, answer(1, "late")) == ([], [])
    assert exchange(state, DelegateResponseMessage(1, WireError("late"))) == ([], [])
    state.revoke_callback(99)  # never issued
    assert out(state) == ([], [])


def test_a_response_for_an_answered_callback_is_l6() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    call(state, "1")
    call(state, "1")
    state.receive(wait(3, "1"))
    state.events_received()
    assert exchange(state, answer(1, 5)) == ([resolved(1, ToolReturned(5))], [])
    reason = "code-mode client returned unknown delegate request ID 1"
    assert exchange(state, answer(1, 5)) == ([resolved(2, J4), ConnectionEnded(reason, (3,))], [])
    assert state.failure == reason


@pytest.mark.parametrize("delegate_id", [99, 0, -1])
def test_a_response_for_a_never_issued_id_is_l6(delegate_id: int) -> None:
    state = host()
    reason = f"code-mode client returned unknown delegate request ID {delegate_id}"
    assert exchange(state, answer(delegate_id)) == ([ConnectionEnded(reason)], [])


def test_the_last_4096_revoked_ids_are_remembered() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    for _ in range(RECENT_ID_MEMORY + 1):
        state.revoke_callback(state.start_tool_call(S1, tool_call("1")))
    assert len(sent(state)) == 2 * (RECENT_ID_MEMORY + 1)
    assert exchange(state, answer(2)) == ([], [])  # still remembered
    for delegate_id in range(1, RECENT_ID_MEMORY + 2):  # every grace runs out
        state.revocation_expired(delegate_id)
    assert len(state.events_received()) == RECENT_ID_MEMORY + 1
    reason = "code-mode client returned unknown delegate request ID 1"
    assert exchange(state, answer(1)) == ([ConnectionEnded(reason)], [])


def test_a_revoked_callback_ends_when_its_grace_runs_out() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    assert call(state, "1")[0] == 1
    state.revoke_callback(1)
    assert sent(state) == [DelegateCancel(1)]
    assert exchange(state, answer(1)) == ([], [])  # its answer no longer counts
    state.revocation_expired(1)
    state.revocation_expired(1)  # once
    assert out(state) == ([resolved(1, "code-mode callback was revoked")], [])
    state.revocation_expired(99)  # unknown: nothing
    assert out(state) == ([], [])


# -- cell/closed and session/closed ordering (§8.3) ----------------------------------------------


def test_cell_closed_waits_for_the_initial_response() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    # The runtime retires a completed cell before the glue reports its initial response.
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == []
    assert state.active_cells == 1
    state.initial_response(2, result("1"))
    assert sent(state) == [initial(2, "1"), cell_closed("1")]
    assert state.active_cells == 0
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == []  # exactly once


def test_cell_closed_after_an_error_initial_response() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    state.cell_closed(S1, CellId("1"))
    state.operation_failed(2, "exec runtime ended unexpectedly")
    assert sent(state) == [
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
    state.events_received()
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == []
    terminated = LiveCell(Terminated(CellId("1"), []))
    state.wait_completed(3, terminated)
    assert len(sent(state)) == 1
    state.operation_failed(4, "exec cell 1 is already terminating")
    assert len(sent(state)) == 1
    state.wait_completed(6, MissingCell(Result(CellId("other"), [], "exec cell other not found")))
    assert len(sent(state)) == 1
    state.wait_completed(5, terminated)
    last = sent(state)
    assert last[1:] == [cell_closed("1")]
    assert isinstance(last[0], OperationResponse) and last[0].id == 5


def test_a_cancelled_wait_releases_its_cell() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(wait(3, "1"))
    state.receive(OperationCancel(3))
    state.events_received()
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == []
    state.operation_cancelled(3)
    assert sent(state) == [*refused(3, H1), cell_closed("1")]


def test_cell_closed_revokes_pending_callbacks_first() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    call(state, "1")
    note(state, "1")
    state.cell_closed(S1, CellId("1"))
    # Newest first, as the upstream host revokes them.
    assert sent(state) == [DelegateCancel(2), DelegateCancel(1), cell_closed("1")]
    assert state.pending_callbacks == 0
    assert state.active_cells == 0
    assert exchange(state, answer(1)) == ([], [])


def test_cell_closed_with_callbacks_and_an_open_answer() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    call(state, "1")
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [DelegateCancel(1)]
    state.initial_response(2, result("1"))
    assert sent(state) == [initial(2, "1"), cell_closed("1")]


def test_a_wait_for_a_cell_admitted_later_does_not_hold_it() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    # A client that guesses the next cell id: the wait names a cell the host does not know yet.
    state.receive(wait(3, "1"))
    state.events_received()
    assert state.execution_started(2, CellId("1"))
    assert sent(state) == [started(2, "1")]
    state.cell_closed(S1, CellId("1"))
    state.wait_completed(3, MissingCell(Result(CellId("1"), [], "exec cell 1 not found")))
    assert len(sent(state)) == 1  # no cell/closed yet
    state.initial_response(2, result("1"))
    assert sent(state) == [initial(2, "1"), cell_closed("1")]


def test_no_cell_closed_for_a_cell_never_announced() -> None:
    state = host()
    opened(state)
    state.cell_closed(S1, CellId("9"))
    state.cell_closed("unknown", CellId("9"))
    assert out(state) == ([], [])
    assert state.active_cells == 0


def test_session_closed_follows_the_last_cell_closed() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    finished_cell(state, 3, "2")
    assert exchange(state, shutdown(4)) == ([StartShutdown(4, S1)], [])
    state.session_shut_down(4)
    assert sent(state) == []
    assert state.in_flight(4)
    assert exchange(state, OperationCancel(4)) == ([], [])
    state.cell_closed(S1, CellId("2"))
    assert sent(state) == [cell_closed("2")]
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [cell_closed("1"), ok(4, SessionClosed(S1))]
    assert not state.in_flight(4)


def test_session_closed_when_the_cells_closed_first() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.receive(shutdown(3))
    state.events_received()
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [cell_closed("1")]
    state.session_shut_down(3)
    assert sent(state) == [ok(3, SessionClosed(S1))]


def test_session_closed_waits_for_a_deferred_cell_closed() -> None:
    state = host()
    opened(state)
    admitted(state, 2, "1")
    call(state, "1")
    state.receive(shutdown(3))
    state.events_received()
    # Shutdown terminates the cell: the call is revoked, the cell retired, but the initial
    # response is still being produced.
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [DelegateCancel(1)]
    state.session_shut_down(3)
    assert sent(state) == []
    state.initial_response(2, Terminated(CellId("1"), []))
    assert sent(state) == [
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
    state.events_received()
    state.session_shut_down(5)
    assert sent(state) == []
    state.cell_closed(S2, CellId("1"))
    assert sent(state) == [cell_closed("1", S2)]
    state.cell_closed(S1, CellId("1"))
    assert sent(state) == [cell_closed("1", S1), ok(5, SessionClosed(S1))]


# -- the end and late reports ----------------------------------------------------------------------


def test_nothing_is_produced_after_the_end() -> None:
    state = host()
    opened(state)
    finished_cell(state, 2, "1")
    state.close()
    assert out(state) == ([ConnectionEnded(None)], [])
    # The glue stops its sessions; the runtime retires the cell.
    state.cell_closed(S1, CellId("1"))
    assert out(state) == ([], [])


def test_session_closed_waits_for_an_admission_the_shutdown_overtook() -> None:
    state = host()
    opened(state)
    state.receive(execute(2))
    state.receive(shutdown(3))
    state.events_received()
    # The runtime admitted the cell, then its shutdown retired it (unannounced) and finished
    # before the execute's task resumed.
    state.cell_closed(S1, CellId("1"))
    state.session_shut_down(3)
    assert sent(state) == []  # session/closed is the session's last message
    assert state.execution_started(2, CellId("1")) is False
    assert sent(state) == [*refused(2, f"unknown code-mode session {S1}"), ok(3, SessionClosed(S1))]


# -- ordered_refusals: answers in arrival order ------------------------------------------------------


def test_ordered_refusals_wait_behind_the_requests_before_them() -> None:
    state = host(ordered_refusals=True)
    for message in (open_(1), wait(2, "1", session="zz"), open_(3, "s2"), shutdown(4, "nope")):
        state.receive(message)
    events, messages = out(state)
    assert [type(event) for event in events] == [OpenSession, OpenSession]
    assert messages == []  # both refusals wait behind the open that came first
    state.session_opened(1)
    assert sent(state) == [
        ok(1, SessionReady(S1)),
        OperationResponse(2, WireError("unknown code-mode session zz")),
    ]
    state.session_opened(3)
    assert sent(state) == [
        ok(3, SessionReady("s2")),
        OperationResponse(4, WireError("unknown code-mode session nope")),
    ]
    # With nothing before it unanswered, a refusal leaves at once.
    state.receive(wait(5, "1", session="zz"))
    assert sent(state) == refused(5, "unknown code-mode session zz")


def test_held_refusals_leave_when_the_glue_releases_them() -> None:
    state = host(ordered_refusals=True)
    state.receive(open_(1))
    state.receive(wait(2, "1", session="zz"))
    out(state)
    assert state.holds_refusals
    state.release_refusals()
    assert sent(state) == refused(2, "unknown code-mode session zz")
    assert not state.holds_refusals
    state.session_opened(1)
    assert sent(state) == [ok(1, SessionReady(S1))]


def test_a_refusal_released_early_still_waits_for_an_execute_not_yet_admitted() -> None:
    # Guards: an execute whose session's engine was still starting (not admitted when the glue
    # released the refusals) was overtaken by a refusal read after it; the upstream host, which
    # admits at once, answers them in arrival order.
    state = host(ordered_refusals=True)
    opened(state)
    for message in (wait(2, "7"), execute(3), open_(4)):
        state.receive(message)
    out(state)
    state.release_refusals()
    assert sent(state) == []  # the open's refusal waits behind the execute
    assert state.holds_refusals
    assert state.execution_started(3, CellId("1"))
    assert sent(state) == [
        ok(3, ExecutionStarted("1")),
        OperationResponse(4, WireError(f"code-mode session ID `{S1}` is already open")),
    ]
    # The wait before them was no reason to hold the refusal: it answers whenever it does.
    state.wait_completed(2, MissingCell(Result(CellId("7"), [], "exec cell 7 not found")))
    assert [type(message) for message in sent(state)] == [OperationResponse]
    assert not state.holds_refusals


def test_held_refusals_go_out_before_the_connection_ends() -> None:
    state = host(ordered_refusals=True)
    state.receive(open_(1))
    state.receive(wait(2, "1", session="zz"))
    out(state)
    state.close()
    events, messages = out(state)
    assert messages == refused(2, "unknown code-mode session zz")
    assert isinstance(events[-1], ConnectionEnded)


def test_without_ordered_refusals_a_refusal_leaves_at_once() -> None:
    state = host()
    state.receive(open_(1))
    state.receive(wait(2, "1", session="zz"))
    events, messages = out(state)
    assert [type(event) for event in events] == [OpenSession]
    assert messages == refused(2, "unknown code-mode session zz")
