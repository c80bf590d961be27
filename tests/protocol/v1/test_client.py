"""The sans-I/O V1 client machine (``protocol-v1.md`` §3.4, §9): the handshake, every message,
every K/D/C text, every cancellation path, lanes and byte input.

Host messages are fed decoded (or as bytes where framing matters); what comes out is compared
exactly: the events, and the frames decoded back to messages with their lanes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import pytest

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    LocalProtocolError,
    WireConversionError,
)
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    I32_MAX,
    I64_MAX,
    MAX_FRAME_BYTES,
    RECENT_ID_MEMORY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
    U64_MAX,
)
from codemode.protocol.delegation import CallbackFailed, NotificationAccepted, ToolReturned
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
from codemode.protocol.v1.client import ClientProtocol
from codemode.protocol.v1.codec import MessageDecoder, encode_frame
from codemode.protocol.v1.events import (
    CallbackCancelled,
    CallbackRequested,
    CellClosed,
    CellStarted,
    ClientEvent,
    ConnectionEnded,
    HandshakeComplete,
    InitialResponse,
    NotificationCallback,
    OperationFailed,
    SessionForgotten,
    SessionOpened,
    SessionShutDown,
    ToolCallback,
    WaitAnswered,
)
from codemode.protocol.v1.handshake import Negotiated, client_hello
from codemode.protocol.v1.lanes import Lane
from codemode.protocol.v1.messages import (
    UNSET,
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostResponse,
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
from codemode.protocol.v1.messages import CellClosed as WireCellClosed
from codemode.protocol.v1.revision import WireRevision

S1 = "session-1"
CELL = "1"
LIMITS = SESSION_RESOURCE_LIMITS_CAPABILITY
DUAL = DUAL_WEBSOCKET_CAPABILITY
REQUEST = ExecuteRequest("call-1", "text('x')", [], 5000, 1000)

# Exact texts, written out so that a change of wording fails here.
K1 = "code-mode host connection closed"
C3 = "code-mode host exited during handshake"
C10 = "code-mode session closed during execute"
K19 = "code-mode host request ID space exhausted"
D1 = "code-mode host exceeded the limit of 1024 pending delegate calls"
CANCELLED = "code-mode request cancelled"

Outcome: TypeAlias = tuple[list[ClientEvent], list[ClientToHost]]
NOTHING: Final[Outcome] = ([], [])

_DECODER: Final[MessageDecoder[ClientToHost]] = MessageDecoder(ClientToHost)

# -- helpers -------------------------------------------------------------------------------------


def ready(*, limits: bool = True, dual: bool = False) -> ConnectionReady:
    granted = ([LIMITS] if limits else []) + ([DUAL] if dual else [])
    return ConnectionReady(1, tuple(granted), "tok" if dual else UNSET)


def connected(
    *,
    limits: bool = True,
    dual: bool = False,
    first_request_id: int = 1,
    wire_revision: WireRevision | str = WireRevision.PINNED,
) -> ClientProtocol:
    """A machine whose handshake (and bulk pairing) completed, with nothing left to take."""
    protocol = ClientProtocol(
        dual_websocket=dual, wire_revision=wire_revision, first_request_id=first_request_id
    )
    assert sent(protocol) == [client_hello(dual_websocket=dual)]
    reply = ready(limits=limits, dual=dual)
    protocol.receive(reply)
    granted = Negotiated(frozenset(reply.capabilities), "tok" if dual else None)
    assert protocol.events_received() == [HandshakeComplete(granted)]
    assert protocol.negotiated == granted
    if dual:
        protocol.bulk_opened()
    assert protocol.data_to_send() == []
    return protocol


def decode(frame: bytes | bytearray) -> ClientToHost:
    assert int.from_bytes(frame[:4], "little") == len(frame) - 4
    return _DECODER.decode(bytes(frame), 4)


def frames(protocol: ClientProtocol) -> list[tuple[ClientToHost, Lane]]:
    """What the machine queued, decoded back, with lanes."""
    return [(decode(frame), lane) for frame, lane in protocol.data_to_send()]


def sent(protocol: ClientProtocol) -> list[ClientToHost]:
    """What the machine queued, decoded back; on a single-socket connection every frame must be
    on the control lane."""
    queued = frames(protocol)
    if not protocol.negotiated.dual_websocket:
        assert all(lane is Lane.CONTROL for _, lane in queued)
    return [message for message, _ in queued]


def outcome(protocol: ClientProtocol) -> Outcome:
    return protocol.events_received(), sent(protocol)


def deliver(protocol: ClientProtocol, message: HostToClient, lane: Lane = Lane.CONTROL) -> Outcome:
    protocol.receive(message, lane)
    return outcome(protocol)


def violation(
    protocol: ClientProtocol, message: HostToClient, text: str, lane: Lane = Lane.CONTROL
) -> list[ClientEvent]:
    """Feed a message that breaks the protocol: the connection must end with exactly ``text``.
    Returns the events after ``ConnectionEnded``."""
    protocol.receive(message, lane)
    return ended(protocol, text)


def ended(protocol: ClientProtocol, text: str) -> list[ClientEvent]:
    assert protocol.failure == text
    assert not protocol.is_alive()
    assert protocol.ended
    events = protocol.events_received()
    assert events[:1] == [ConnectionEnded(text)]
    assert ConnectionEnded(text) not in events[1:]
    return events[1:]


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


def invocation(cell: str = CELL) -> WireNestedToolCall:
    return WireNestedToolCall(cell, "tool-1", WireToolName("echo", None), "function", {"v": 1})


def tool_request(delegate_id: int, cell: str = CELL, session: str = S1) -> DelegateRequestMessage:
    return DelegateRequestMessage(delegate_id, session, ToolInvoke(invocation(cell)))


def note_request(delegate_id: int, cell: str = CELL, session: str = S1) -> DelegateRequestMessage:
    return DelegateRequestMessage(delegate_id, session, NotificationSend("call-1", cell, "hi"))


def error_response(delegate_id: int, message: str) -> DelegateResponseMessage:
    return DelegateResponseMessage(delegate_id, WireError(message))


def tool_result(delegate_id: int, value: Any) -> DelegateResponseMessage:
    return DelegateResponseMessage(delegate_id, WireOk(ToolResult(value)))


def call(cell: str = CELL) -> ToolCallback:
    return ToolCallback(
        CodeModeNestedToolCall(
            CellId(cell), "tool-1", ToolName("echo"), CodeModeToolKind.FUNCTION, {"v": 1}
        )
    )


def note(cell: str = CELL) -> NotificationCallback:
    return NotificationCallback("call-1", CellId(cell), "hi")


def open_request(request_id: int, session: str) -> OperationRequest:
    return OperationRequest(request_id, SessionOpen(session))


def wait_request(request_id: int, cell: str = CELL, ms: int = 1, session: str = S1) -> Any:
    return OperationRequest(request_id, SessionWait(session, WireWaitRequest(cell, ms)))


def opened(
    protocol: ClientProtocol, limits: CodeModeSessionCellExecutionLimits | None = None
) -> str:
    request_id = protocol.open_session(limits)
    session_id = protocol.session_of(request_id)
    ((message,), events) = sent(protocol), protocol.events_received()
    assert events == []
    assert isinstance(message, OperationRequest) and message.id == request_id
    assert deliver(protocol, respond(request_id, SessionReady(session_id))) == (
        [SessionOpened(request_id, session_id)],
        [],
    )
    return session_id


def execute(protocol: ClientProtocol, session: str = S1) -> int:
    request_id = protocol.execute(session, REQUEST)
    ((message,), events) = sent(protocol), protocol.events_received()
    assert events == []
    assert isinstance(message, OperationRequest) and message.id == request_id
    assert isinstance(message.request, SessionExecute)
    return request_id


def start_cell(protocol: ClientProtocol, cell: str = CELL, session: str = S1) -> int:
    """Execute and admit ``cell``; returns the execute's request id."""
    request_id = execute(protocol, session)
    assert deliver(protocol, respond(request_id, ExecutionStarted(cell))) == (
        [CellStarted(request_id, session, CellId(cell))],
        [],
    )
    return request_id


def run_cell(protocol: ClientProtocol, cell: str = CELL, session: str = S1) -> int:
    """Execute, admit and deliver the initial response of ``cell``."""
    request_id = start_cell(protocol, cell, session)
    events, sends = deliver(protocol, initial(request_id, cell))
    assert len(events) == 1 and isinstance(events[0], InitialResponse) and sends == []
    return request_id


def wait(protocol: ClientProtocol, cell: str = CELL, ms: int = 1, session: str = S1) -> int:
    return protocol.wait(session, WaitRequest(CellId(cell), ms))


def exactly(text: str) -> str:
    return "^" + re.escape(text) + "$"


# -- construction and the handshake --------------------------------------------------------------


@pytest.mark.parametrize("dual", [False, True])
def test_hello_is_queued_at_construction(dual: bool) -> None:
    protocol = ClientProtocol(dual_websocket=dual)
    hello = client_hello(dual_websocket=dual)
    assert protocol.data_to_send() == [(encode_frame(hello), Lane.CONTROL)]
    assert protocol.data_to_send() == []
    assert protocol.events_received() == []
    assert not protocol.handshaken
    assert protocol.negotiated == Negotiated(frozenset(), None)
    assert protocol.is_alive() and not protocol.ended and protocol.failure is None
    optional = (DUAL, LIMITS) if dual else (LIMITS,)
    assert hello == ConnectionHello((1,), (), optional)


def test_operations_before_the_handshake_are_refused() -> None:
    protocol = ClientProtocol()
    protocol.data_to_send()
    protocol.bulk_opened()  # no bulk socket to speak of yet: ignored
    with pytest.raises(LocalProtocolError, match=r"^the connection is not open yet"):
        protocol.open_session()
    with pytest.raises(LocalProtocolError, match=r"^request 1 is not pending$"):
        protocol.session_of(1)
    assert outcome(protocol) == NOTHING
    assert protocol.is_alive()
    # Nothing was consumed by the refusal.
    protocol.receive(ready())
    assert protocol.open_session() == 1


def test_ready_completes_the_handshake() -> None:
    protocol = ClientProtocol()
    protocol.data_to_send()
    assert deliver(protocol, ConnectionReady(1, (LIMITS,))) == (
        [HandshakeComplete(Negotiated(frozenset({LIMITS}), None))],
        [],
    )
    assert protocol.handshaken
    assert protocol.negotiated.resource_limits
    assert not protocol.negotiated.dual_websocket
    assert protocol.open_session() == 1
    assert sent(protocol) == [open_request(1, S1)]


def test_ready_granting_nothing_refuses_limits_with_c7() -> None:
    protocol = connected(limits=False)
    assert protocol.negotiated == Negotiated(frozenset(), None)
    with pytest.raises(CodeModeError) as caught:
        protocol.open_session(CodeModeSessionCellExecutionLimits(max_yield_time_ms=250))
    assert caught.value.message == (
        "code-mode host does not support session resource limits: "
        "missing `session-cell-execution-resource-limits` capability"
    )
    assert protocol.is_alive()


def test_dual_asked_but_not_granted_is_a_single_socket_connection() -> None:
    protocol = ClientProtocol(dual_websocket=True)
    protocol.data_to_send()
    protocol.receive(ready())
    assert protocol.events_received() == [HandshakeComplete(Negotiated(frozenset({LIMITS}), None))]
    opened(protocol)  # no pairing needed
    run_cell(protocol)
    protocol.receive(tool_request(1), Lane.CONTROL)  # lanes are not checked
    protocol.events_received()
    protocol.finish_callback(1, ToolReturned(None))
    assert frames(protocol) == [(tool_result(1, None), Lane.CONTROL)]


@pytest.mark.parametrize(
    ("reply", "text"),
    [
        (
            ConnectionRejected(InvalidHello("first message must be connection/hello")),
            "code-mode host rejected the handshake: "
            "invalid hello: first message must be connection/hello",
        ),
        (
            ConnectionRejected(NoCompatibleVersion((2, 3))),
            "code-mode host rejected the handshake: "
            "no compatible protocol version (host supports 2, 3)",
        ),
        (
            ConnectionRejected(MissingRequiredCapability("x")),
            "code-mode host rejected the handshake: missing required capability `x`",
        ),
    ],
)
def test_rejected_handshake_is_c4(reply: ConnectionRejected, text: str) -> None:
    protocol = ClientProtocol()
    protocol.data_to_send()
    assert violation(protocol, reply, text) == []
    assert not protocol.handshaken
    assert sent(protocol) == []
    with pytest.raises(ConnectionClosed, match=exactly(text)):
        protocol.open_session()


INVALID = "code-mode host returned an invalid handshake response: "
READY_LENGTH = len(encode_frame(ready())) - 4


@pytest.mark.parametrize(
    ("dual", "reply", "detail"),
    [
        (False, respond(1, SessionReady(S1)), "expected connection/ready, got operation/response"),
        (False, DelegateCancel(1), "expected connection/ready, got delegate/cancel"),
        (False, ConnectionReady(2, ()), "host selected unsupported protocol version 2"),
        (False, ConnectionReady(1, ("other",)), "host granted unrequested capability `other`"),
        (
            False,
            ConnectionReady(1, (DUAL,), "tok"),
            "host granted unrequested capability `dual-websocket-v1`",
        ),
        (False, ConnectionReady(1, (), "tok"), "bulkConnectionToken without `dual-websocket-v1`"),
        (True, ConnectionReady(1, (DUAL,)), "bulkConnectionToken is missing"),
        (
            True,
            ConnectionReady(1, (LIMITS,), "tok"),
            "bulkConnectionToken without `dual-websocket-v1`",
        ),
    ],
)
def test_invalid_handshake_reply_is_c5(dual: bool, reply: HostToClient, detail: str) -> None:
    protocol = ClientProtocol(dual_websocket=dual)
    protocol.data_to_send()
    assert violation(protocol, reply, INVALID + detail) == []
    assert not protocol.handshaken
    protocol.bulk_opened()
    with pytest.raises(ConnectionClosed, match=exactly(INVALID + detail)):
        protocol.open_session()
    # Nothing is received after the end, not even a proper reply.
    assert deliver(protocol, ready()) == NOTHING


def test_handshake_timeout_is_c2_only_before_the_reply() -> None:
    protocol = ClientProtocol()
    protocol.timed_out()
    assert ended(protocol, "timed out negotiating with the code-mode host") == []
    assert sent(protocol) == [client_hello()]  # the hello is still there to write

    protocol = connected()
    protocol.timed_out()
    assert protocol.is_alive() and outcome(protocol) == NOTHING

    protocol = ClientProtocol(dual_websocket=True)
    protocol.receive(ready(dual=True))
    protocol.timed_out()  # pairing has its own deadline (bulk_failed)
    assert protocol.is_alive()


HANDSHAKE_ENDINGS: Final[list[tuple[str, Callable[[ClientProtocol], None]]]] = [
    ("close", lambda p: p.close()),
    ("eof", lambda p: p.receive_eof()),
    ("read", lambda p: p.read_failed("reset")),
    ("write", lambda p: p.write_failed("broken pipe")),
    ("exit", lambda p: p.host_exited(1)),
    ("text", lambda p: p.text_received()),
]


@pytest.mark.parametrize(
    "end", [end for _, end in HANDSHAKE_ENDINGS], ids=[name for name, _ in HANDSHAKE_ENDINGS]
)
def test_any_end_before_the_reply_is_c3(end: Callable[[ClientProtocol], None]) -> None:
    protocol = ClientProtocol()
    protocol.data_to_send()
    end(protocol)
    assert ended(protocol, C3) == []
    with pytest.raises(ConnectionClosed, match=exactly(C3)):
        protocol.open_session()


def test_handshake_reply_as_bytes_in_any_chunks() -> None:
    frame = bytes(encode_frame(ready()))
    protocol = ClientProtocol()
    protocol.data_to_send()
    for index in range(len(frame)):
        protocol.receive_data(frame[index : index + 1])
        if index < len(frame) - 1:
            assert protocol.events_received() == []
    assert protocol.events_received() == [HandshakeComplete(Negotiated(frozenset({LIMITS}), None))]

    protocol = ClientProtocol()
    protocol.receive_frame(frame)
    assert protocol.handshaken


@pytest.mark.parametrize(
    ("feed", "detail"),
    [
        (
            lambda p: p.receive_frame(b"\x01\x00"),
            "code-mode IPC frame is missing its length prefix",
        ),
        (
            lambda p: p.receive_frame(bytes(encode_frame(ready())) + b"x"),
            f"code-mode IPC frame declares {READY_LENGTH} payload bytes "
            f"but contains {READY_LENGTH + 1}",
        ),
        (
            lambda p: (p.receive_data(bytes(encode_frame(ready()))[:10]), p.receive_eof()),
            f"code-mode IPC frame payload truncated: declared {READY_LENGTH} bytes, received 6",
        ),
        (
            lambda p: p.receive_data((MAX_FRAME_BYTES + 1).to_bytes(4, "little")),
            f"code-mode IPC frame length {MAX_FRAME_BYTES + 1} exceeds {MAX_FRAME_BYTES} bytes",
        ),
    ],
    ids=["no-prefix", "trailing", "truncated", "oversize"],
)
def test_bytes_that_are_not_a_frame_during_the_handshake_are_c5(
    feed: Callable[[ClientProtocol], object], detail: str
) -> None:
    protocol = ClientProtocol()
    protocol.data_to_send()
    feed(protocol)
    assert ended(protocol, INVALID + detail) == []


def test_undecodable_handshake_reply_is_c5() -> None:
    protocol = ClientProtocol()
    protocol.receive_data(b"\x02\x00\x00\x00{]")
    assert protocol.failure is not None
    assert protocol.failure.startswith(INVALID + "failed to decode code-mode IPC frame: ")
    assert protocol.events_received() == [ConnectionEnded(protocol.failure)]


def test_dual_pairing() -> None:
    protocol = ClientProtocol(dual_websocket=True)
    assert frames(protocol) == [(client_hello(dual_websocket=True), Lane.CONTROL)]
    granted = Negotiated(frozenset({DUAL, LIMITS}), "tok")
    assert deliver(protocol, ready(dual=True)) == ([HandshakeComplete(granted)], [])
    assert protocol.handshaken
    assert protocol.negotiated.dual_websocket
    assert protocol.negotiated.bulk_connection_token == "tok"
    with pytest.raises(LocalProtocolError, match=r"^the connection is not open yet"):
        protocol.open_session()
    protocol.timed_out()
    assert protocol.is_alive()
    protocol.bulk_opened()
    assert protocol.open_session() == 1
    assert frames(protocol) == [(open_request(1, S1), Lane.CONTROL)]
    protocol.bulk_opened()  # again: harmless
    assert protocol.is_alive()


def test_bulk_failure_is_c6() -> None:
    protocol = ClientProtocol(dual_websocket=True)
    protocol.receive(ready(dual=True))
    protocol.events_received()
    protocol.bulk_failed("connection refused")
    text = "code-mode host bulk connection is unavailable: connection refused"
    assert ended(protocol, text) == []
    protocol.bulk_opened()
    with pytest.raises(ConnectionClosed, match=exactly(text)):
        protocol.open_session()


@pytest.mark.parametrize(
    "reply", [ready(), ConnectionRejected(InvalidHello("first message must be connection/hello"))]
)
@pytest.mark.parametrize("dual", [False, True])
def test_second_handshake_reply_is_k5(reply: HostToClient, dual: bool) -> None:
    protocol = ClientProtocol(dual_websocket=dual)
    protocol.receive(ready(dual=dual))
    protocol.events_received()  # still pairing when dual: the rule holds all the same
    assert violation(protocol, reply, "code-mode host sent a second handshake response") == []


# -- byte input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_receive_data_in_any_chunking(chunk: int) -> None:
    protocol = connected()
    opened(protocol)
    execute_id = execute(protocol)
    data = b"".join(
        bytes(encode_frame(message))
        for message in (
            tool_request(1),  # parked behind the admitting execute
            respond(execute_id, ExecutionStarted(CELL)),
            initial(execute_id, CELL, "out"),
            note_request(2, session="nope"),
            WireCellClosed(S1, CELL),
        )
    )
    events: list[ClientEvent] = []
    for start in range(0, len(data), chunk):
        protocol.receive_data(memoryview(data)[start : start + chunk])
        events += protocol.events_received()
    assert events == [
        CellStarted(execute_id, S1, CellId(CELL)),
        CallbackRequested(1, S1, call()),
        InitialResponse(execute_id, Result(CellId(CELL), [InputText("out")], None)),
        CallbackCancelled(1),
    ]
    assert sent(protocol) == [
        error_response(2, "code-mode host delegated for unknown session nope")
    ]
    assert protocol.is_alive()


def test_receive_data_keeps_a_partial_frame_across_calls() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    frame = bytes(encode_frame(respond(request_id, SessionReady(S1))))
    protocol.receive_data(bytearray(frame[:5]))
    assert outcome(protocol) == NOTHING
    protocol.receive_data(frame[5:] + frame[:3])  # the rest, then 3 bytes of nothing complete
    assert protocol.events_received() == [SessionOpened(request_id, S1)]
    assert protocol.is_alive()


def test_receive_frame_takes_one_whole_frame() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    protocol.receive_frame(encode_frame(respond(request_id, SessionReady(S1))))
    assert outcome(protocol) == ([SessionOpened(request_id, S1)], [])


def test_receive_frame_with_two_frames_is_k3() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    one = bytes(encode_frame(respond(request_id, SessionReady(S1))))
    protocol.receive_frame(one + one)
    length = len(one) - 4
    text = (
        "failed to read code-mode host message: "
        f"code-mode IPC frame declares {length} payload bytes but contains {2 * length + 4}"
    )
    assert ended(protocol, text) == [OperationFailed(request_id, text, connection_lost=True)]


def test_receive_frame_without_a_prefix_is_k3() -> None:
    protocol = connected()
    protocol.receive_frame(b"")
    assert (
        ended(
            protocol,
            "failed to read code-mode host message: code-mode IPC frame is missing its length prefix",
        )
        == []
    )


def test_clean_eof_is_k1() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.receive_eof()
    assert ended(protocol, K1) == [OperationFailed(request_id, K1, connection_lost=True)]
    protocol.receive_eof()
    protocol.receive_data(b"\x00")
    assert outcome(protocol) == NOTHING


def test_eof_after_complete_frames_processes_them_first() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    protocol.receive_data(encode_frame(respond(request_id, SessionReady(S1))))
    protocol.receive_eof()
    assert protocol.events_received() == [SessionOpened(request_id, S1), ConnectionEnded(K1)]


@pytest.mark.parametrize(
    ("cut", "detail"),
    [
        (2, "code-mode IPC frame length prefix truncated after 2 bytes"),
        (9, "code-mode IPC frame payload truncated: declared {} bytes, received 5"),
    ],
)
def test_truncated_frame_at_eof_is_k3(cut: int, detail: str) -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    frame = bytes(encode_frame(respond(request_id, SessionReady(S1))))
    protocol.receive_data(frame[:cut])
    assert protocol.is_alive()
    protocol.receive_eof()
    text = "failed to read code-mode host message: " + detail.format(len(frame) - 4)
    assert ended(protocol, text) == [OperationFailed(request_id, text, connection_lost=True)]


def test_oversize_length_prefix_is_k3_at_once() -> None:
    protocol = connected()
    protocol.receive_data((MAX_FRAME_BYTES + 1).to_bytes(4, "little"))
    assert (
        ended(
            protocol,
            "failed to read code-mode host message: "
            f"code-mode IPC frame length {MAX_FRAME_BYTES + 1} exceeds {MAX_FRAME_BYTES} bytes",
        )
        == []
    )


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b"{]", "failed to decode code-mode IPC frame: "),
        (b'{"type":"nope"}', "failed to decode code-mode IPC frame: "),
        (b'{"type":"delegate/cancel","id":1,"id":2}', "failed to decode code-mode IPC frame: "),
        (b'"connection/hello"', "failed to decode code-mode IPC frame: "),
    ],
)
def test_undecodable_frame_is_k3_after_the_frames_before_it(payload: bytes, detail: str) -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    good = bytes(encode_frame(respond(request_id, SessionReady(S1))))
    bad = len(payload).to_bytes(4, "little") + payload
    protocol.receive_data(good + bad + good)
    events = protocol.events_received()
    assert events[0] == SessionOpened(request_id, S1)
    failure = protocol.failure
    assert failure is not None
    assert failure.startswith("failed to read code-mode host message: " + detail)
    assert events[1:] == [ConnectionEnded(failure)]


def test_latest_wire_revision_needs_the_timing_fields() -> None:
    protocol = connected(wire_revision=WireRevision.LATEST)
    opened(protocol)
    request_id = start_cell(protocol)
    timed = WireRuntimeResponse(
        result=WireResultBody(
            CELL, [], None, result_buffered_for_ns=5, code_mode_host_duration_ns=7
        )
    )
    protocol.receive_frame(encode_frame(ExecuteInitialResponse(request_id, WireOk(timed))))
    ((event,), sends) = outcome(protocol)
    assert sends == []
    assert isinstance(event, InitialResponse) and isinstance(event.response, Result)
    assert event.response.host_duration_ns == 7
    assert event.response.result_buffered_for_ns == 5

    request_id = start_cell(protocol, "2")
    protocol.receive_frame(encode_frame(initial(request_id, "2")))
    text = (
        "failed to read code-mode host message: failed to decode code-mode IPC frame: "
        "Object missing required field `result_buffered_for_ns` - at `$.result.value.Result`"
    )
    assert ended(protocol, text) == [
        OperationFailed(request_id, text, connection_lost=True),
        CellClosed(S1, CellId(CELL)),
        CellClosed(S1, CellId("2")),
    ]


def test_pinned_wire_revision_refuses_the_timing_fields() -> None:
    protocol = connected(wire_revision="pinned")
    opened(protocol)
    wait_id = wait(protocol)
    protocol.data_to_send()
    body = WireRuntimeResponse(yielded=WireYielded(CELL, [], code_mode_host_duration_ns=1))
    protocol.receive_data(encode_frame(respond(wait_id, WaitCompleted(WireWaitOutcome(body)))))
    text = (
        "failed to read code-mode host message: failed to decode code-mode IPC frame: Object "
        "contains unknown field `code_mode_host_duration_ns` - at "
        "`$.result.value.outcome.LiveCell.Yielded`"
    )
    assert ended(protocol, text) == [OperationFailed(wait_id, text, connection_lost=True)]


# -- lanes ---------------------------------------------------------------------------------------


def test_single_socket_sends_everything_on_control_and_ignores_arrival_lanes() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    # Messages of the bulk family arriving "on control" and the other way round are fine.
    assert deliver(protocol, tool_request(1), Lane.CONTROL)[0] == [CallbackRequested(1, S1, call())]
    assert deliver(protocol, note_request(2), Lane.BULK)[0] == [CallbackRequested(2, S1, note())]
    protocol.receive(tool_request(3, cell="9"), Lane.BULK)  # D3
    protocol.finish_callback(1, ToolReturned(1))
    protocol.finish_callback(2, CallbackFailed("nope"))
    assert frames(protocol) == [
        (
            error_response(3, "code-mode host delegated for unknown cell 9 in session session-1"),
            Lane.CONTROL,
        ),
        (tool_result(1, 1), Lane.CONTROL),
        (error_response(2, "nope"), Lane.CONTROL),
    ]
    assert protocol.is_alive()


def test_dual_lanes_of_what_the_client_sends() -> None:
    protocol = connected(dual=True)
    opened(protocol)
    request_id = start_cell(protocol)
    protocol.receive(tool_request(1), Lane.BULK)
    protocol.receive(note_request(2), Lane.CONTROL)
    protocol.receive(note_request(3), Lane.CONTROL)
    protocol.receive(tool_request(4), Lane.BULK)
    protocol.receive(tool_request(5, cell="9"), Lane.BULK)  # D3
    protocol.receive(note_request(6, session="nope"), Lane.CONTROL)  # D2
    protocol.events_received()
    protocol.finish_callback(1, ToolReturned({"a": 1}))
    protocol.finish_callback(2, NotificationAccepted())
    protocol.finish_callback(3, CallbackFailed("nope"))
    protocol.finish_callback(4, ToolReturned(float("inf")))  # D5
    wait_id = wait(protocol)
    protocol.cancel(wait_id)
    protocol.abandon_cell(S1, CellId(CELL), request_id)
    assert frames(protocol) == [
        (
            error_response(5, "code-mode host delegated for unknown cell 9 in session session-1"),
            Lane.BULK,
        ),
        (error_response(6, "code-mode host delegated for unknown session nope"), Lane.BULK),
        (tool_result(1, {"a": 1}), Lane.BULK),
        (DelegateResponseMessage(2, WireOk(NotificationDelivered())), Lane.CONTROL),
        (error_response(3, "nope"), Lane.BULK),  # every error goes on bulk, even a notification's
        (
            error_response(
                4, "code-mode delegate returned a value that is not JSON: inf is not a JSON number"
            ),
            Lane.BULK,
        ),
        (wait_request(wait_id), Lane.CONTROL),
        (OperationCancel(wait_id), Lane.CONTROL),
        (OperationCancel(request_id), Lane.CONTROL),
        (OperationRequest(wait_id + 1, SessionTerminate(S1, CELL)), Lane.CONTROL),
    ]


def test_dual_d1_refusal_goes_on_bulk() -> None:
    protocol = connected(dual=True)
    opened(protocol)
    run_cell(protocol)
    for delegate_id in range(1, 1025):
        protocol.receive(note_request(delegate_id), Lane.CONTROL)
    protocol.events_received()
    protocol.receive(note_request(1025), Lane.CONTROL)
    assert frames(protocol) == [(error_response(1025, D1), Lane.BULK)]


@pytest.mark.parametrize(
    ("message", "lane", "text"),
    [
        (WireCellClosed(S1, CELL), Lane.BULK, "code-mode host sent cell/closed on the bulk socket"),
        (
            tool_request(1),
            Lane.CONTROL,
            "code-mode host sent delegate/request on the control socket",
        ),
        (note_request(1), Lane.BULK, "code-mode host sent delegate/request on the bulk socket"),
        (
            DelegateCancel(1),
            Lane.CONTROL,
            "code-mode host sent delegate/cancel on the control socket",
        ),
        (live(2, CELL), Lane.BULK, "code-mode host sent operation/response on the bulk socket"),
        (
            initial(2, CELL),
            Lane.BULK,
            "code-mode host sent execute/initialResponse on the bulk socket",
        ),
        (ready(dual=True), Lane.BULK, "code-mode host sent connection/ready on the bulk socket"),
    ],
)
def test_dual_wrong_lane_is_k6(message: HostToClient, lane: Lane, text: str) -> None:
    protocol = connected(dual=True)
    opened(protocol)
    request_id = start_cell(protocol)
    assert violation(protocol, message, text, lane) == [
        OperationFailed(request_id, text, connection_lost=True),
        CellClosed(S1, CellId(CELL)),
    ]


def test_dual_wrong_lane_as_bytes_is_k6() -> None:
    protocol = connected(dual=True)
    protocol.receive_data(encode_frame(DelegateCancel(1)), Lane.CONTROL)
    assert ended(protocol, "code-mode host sent delegate/cancel on the control socket") == []


def test_dual_right_lanes_are_accepted() -> None:
    protocol = connected(dual=True)
    opened(protocol)
    run_cell(protocol)
    assert deliver(protocol, tool_request(1), Lane.BULK) == ([CallbackRequested(1, S1, call())], [])
    assert deliver(protocol, note_request(2), Lane.CONTROL) == (
        [CallbackRequested(2, S1, note())],
        [],
    )
    assert deliver(protocol, DelegateCancel(1), Lane.BULK) == ([CallbackCancelled(1)], [])
    assert protocol.is_alive()


def test_dual_lanes_have_separate_byte_streams() -> None:
    protocol = connected(dual=True)
    opened(protocol)
    run_cell(protocol)
    control = bytes(encode_frame(note_request(1)))
    bulk = bytes(encode_frame(tool_request(2)))
    protocol.receive_data(control[:7], Lane.CONTROL)
    protocol.receive_data(bulk[:9], Lane.BULK)
    protocol.receive_data(control[7:], Lane.CONTROL)
    assert protocol.events_received() == [CallbackRequested(1, S1, note())]
    protocol.receive_data(bulk[9:], Lane.BULK)
    assert protocol.events_received() == [CallbackRequested(2, S1, call())]
    protocol.receive_eof(Lane.BULK)
    assert ended(protocol, K1) == [CallbackCancelled(1), CallbackCancelled(2)]


def test_dual_frames_fed_whole_per_lane() -> None:
    protocol = connected(dual=True)
    opened(protocol)
    run_cell(protocol)
    protocol.receive_frame(encode_frame(tool_request(1)), Lane.BULK)
    assert protocol.events_received() == [CallbackRequested(1, S1, call())]
    protocol.receive_frame(encode_frame(tool_request(2)), Lane.CONTROL)
    assert ended(protocol, "code-mode host sent delegate/request on the control socket") == [
        CallbackCancelled(1)
    ]


# -- open ----------------------------------------------------------------------------------------


def test_open_allocates_request_and_session_ids_in_order() -> None:
    protocol = connected()
    assert protocol.open_session() == 1
    assert protocol.open_session() == 2
    assert protocol.session_of(1) == S1
    assert protocol.session_of(2) == "session-2"
    queued = protocol.data_to_send()
    assert [frame for frame, _ in queued] == [
        encode_frame(open_request(1, S1)),
        encode_frame(open_request(2, "session-2")),
    ]
    assert [lane for _, lane in queued] == [Lane.CONTROL, Lane.CONTROL]
    assert protocol.events_received() == []
    assert protocol.pending_requests() == 2


def test_open_with_limits_needs_the_capability() -> None:
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=250)
    protocol = connected()
    protocol.open_session(limits)
    expected = SessionOpen(S1, WireSessionCellExecutionLimits(max_yield_time_ms=250))
    assert sent(protocol) == [OperationRequest(1, expected)]

    protocol = connected(limits=False)
    with pytest.raises(CodeModeError, match=r"^code-mode host does not support session resource"):
        protocol.open_session(limits)
    # Nothing was consumed: default limits go through without the capability, as id 1.
    assert protocol.open_session(CodeModeSessionCellExecutionLimits()) == 1
    assert sent(protocol) == [open_request(1, S1)]


def test_open_limits_out_of_range_fail_the_call_only() -> None:
    protocol = connected()
    with pytest.raises(WireConversionError, match=r"^out of range integral type conversion"):
        protocol.open_session(CodeModeSessionCellExecutionLimits(max_heap_size_bytes=U64_MAX + 1))
    assert outcome(protocol) == NOTHING
    assert protocol.open_session() == 1
    assert protocol.session_of(1) == S1


def test_open_answers() -> None:
    protocol = connected()
    assert opened(protocol) == S1
    request_id = protocol.open_session()
    session_id = protocol.session_of(request_id)
    protocol.data_to_send()
    reused = "code-mode session ID `session-2` was reused"
    assert deliver(protocol, refuse(request_id, reused)) == (
        [OperationFailed(request_id, reused), SessionForgotten(session_id)],
        [],
    )
    assert protocol.pending_requests() == 0
    with pytest.raises(LocalProtocolError, match=r"^request 2 is not pending$"):
        protocol.session_of(request_id)


def test_operations_on_an_opening_session_are_refused() -> None:
    protocol = connected()
    protocol.open_session()
    protocol.data_to_send()
    operations: list[Callable[[], object]] = [
        lambda: protocol.execute(S1, REQUEST),
        lambda: protocol.wait(S1, WaitRequest(CellId(CELL), 1)),
        lambda: protocol.terminate(S1, CellId(CELL)),
        lambda: protocol.shutdown(S1),
    ]
    for operation in operations:
        with pytest.raises(LocalProtocolError, match=r"^session session-1 is not open yet$"):
            operation()
    assert outcome(protocol) == NOTHING
    assert protocol.open_session() == 2  # no id was consumed


@pytest.mark.parametrize(
    "value", [SessionReady("session-9"), ExecutionStarted("1"), SessionClosed(S1)]
)
def test_invalid_open_response_is_k9(value: HostResponse) -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    text = "code-mode host returned an invalid open-session response"
    assert violation(protocol, respond(request_id, value), text) == [
        OperationFailed(request_id, text, connection_lost=True)
    ]


def test_cancelled_open_is_shut_down_when_ready_arrives() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    protocol.cancel(request_id)
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, respond(request_id, SessionReady(S1))) == (
        [],
        [OperationRequest(2, SessionShutdown(S1))],
    )
    # The session is not usable by anyone.
    with pytest.raises(CodeModeError, match=r"^code mode session is shutting down$"):
        protocol.execute(S1, REQUEST)
    # Its session/closed is not reported to anyone; the session is just forgotten.
    assert deliver(protocol, respond(2, SessionClosed(S1))) == ([SessionForgotten(S1)], [])
    assert protocol.pending_requests() == 0


def test_cancelled_open_refused_is_silent() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.data_to_send()
    protocol.cancel(request_id)
    protocol.cancel(request_id)
    assert deliver(protocol, refuse(request_id, "nope")) == ([SessionForgotten(S1)], [])


def test_cancelled_open_still_validates_its_answer() -> None:
    protocol = connected()
    request_id = protocol.open_session()
    protocol.cancel(request_id)
    protocol.data_to_send()
    assert (
        violation(
            protocol,
            respond(request_id, SessionReady("session-9")),
            "code-mode host returned an invalid open-session response",
        )
        == []
    )


# -- execute -------------------------------------------------------------------------------------


def test_execute_two_phases() -> None:
    protocol = connected()
    opened(protocol)
    tool = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)
    request_id = protocol.execute(S1, ExecuteRequest("call-1", "1", [tool], None, 7))
    wire_tool = WireToolDefinition(
        "echo", WireToolName("echo", None), "Echo", "function", None, None
    )
    assert outcome(protocol) == (
        [],
        [
            OperationRequest(
                request_id,
                SessionExecute(S1, WireExecuteRequest("call-1", [wire_tool], "1", None, 7)),
            )
        ],
    )
    assert deliver(protocol, respond(request_id, ExecutionStarted("g2:42"))) == (
        [CellStarted(request_id, S1, CellId("g2:42"))],
        [],
    )
    assert protocol.open_cells(S1) == 1
    assert protocol.pending_requests() == 1
    assert deliver(protocol, initial(request_id, "g2:42", "out")) == (
        [InitialResponse(request_id, Result(CellId("g2:42"), [InputText("out")], None))],
        [],
    )
    assert protocol.pending_requests() == 0
    assert protocol.open_cells(S1) == 1
    assert deliver(protocol, WireCellClosed(S1, "g2:42")) == ([CellClosed(S1, CellId("g2:42"))], [])
    assert protocol.open_cells(S1) == 0
    assert protocol.open_cells("session-unknown") == 0


def test_execute_refused_and_initial_error() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    cells = "code-mode host has too many active cells"
    assert deliver(protocol, refuse(request_id, cells)) == (
        [OperationFailed(request_id, cells)],
        [],
    )
    request_id = start_cell(protocol)
    error = ExecuteInitialResponse(request_id, WireError("remote runtime failed"))
    assert deliver(protocol, error) == ([OperationFailed(request_id, "remote runtime failed")], [])
    assert protocol.pending_requests() == 0


def test_execute_conversion_failure_sends_nothing() -> None:
    protocol = connected()
    opened(protocol)
    with pytest.raises(WireConversionError):
        protocol.execute(S1, ExecuteRequest("c", "1", [], None, I32_MAX + 1))
    assert outcome(protocol) == NOTHING
    assert execute(protocol) == 2  # id 2 after the open's id 1: nothing was consumed


@pytest.mark.parametrize("value", [SessionReady(S1), SessionClosed(S1)])
def test_invalid_execute_response_is_k10(value: HostResponse) -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    text = "code-mode host returned an invalid execute response"
    assert violation(protocol, respond(request_id, value), text) == [
        OperationFailed(request_id, text, connection_lost=True)
    ]


def test_reused_live_cell_id_is_k16() -> None:
    protocol = connected()
    opened(protocol)
    opened(protocol)
    start_cell(protocol, "7")
    start_cell(protocol, "7", "session-2")  # another session: fine
    request_id = execute(protocol)
    text = "code-mode host reused live cell ID in session session-1"
    events = violation(protocol, respond(request_id, ExecutionStarted("7")), text)
    assert events == [
        OperationFailed(3, text, connection_lost=True),
        OperationFailed(4, text, connection_lost=True),
        OperationFailed(request_id, text, connection_lost=True),
        CellClosed(S1, CellId("7")),
        CellClosed("session-2", CellId("7")),
    ]


def test_a_closed_cell_id_may_be_reused() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol, "7")
    protocol.receive(WireCellClosed(S1, "7"))
    protocol.events_received()
    run_cell(protocol, "7")
    assert protocol.is_alive()


def test_initial_response_for_another_cell_is_k15() -> None:
    protocol = connected()
    opened(protocol)
    request_id = start_cell(protocol, "1")
    text = "code-mode host returned an initial response for cell 2 instead of 1"
    # The validation happens before any change: the bookkeeping is intact for the end.
    assert violation(protocol, initial(request_id, "2"), text) == [
        OperationFailed(request_id, text, connection_lost=True),
        CellClosed(S1, CellId("1")),
    ]


def _k8_before_started(protocol: ClientProtocol) -> HostToClient:
    return initial(execute(protocol), CELL)


def _k8_second_started(protocol: ClientProtocol) -> HostToClient:
    return respond(start_cell(protocol), ExecutionStarted("2"))


def _k8_second_initial(protocol: ClientProtocol) -> HostToClient:
    return initial(run_cell(protocol), CELL)


def _k8_wait_initial(protocol: ClientProtocol) -> HostToClient:
    request_id = wait(protocol)
    protocol.data_to_send()
    return initial(request_id, CELL)


def _k8_terminate_initial(protocol: ClientProtocol) -> HostToClient:
    request_id = protocol.terminate(S1, CellId(CELL))
    protocol.data_to_send()
    return initial(request_id, CELL)


@pytest.mark.parametrize(
    "setup",
    [
        lambda p: respond(99, SessionReady(S1)),  # never sent
        lambda p: respond(1, SessionReady(S1)),  # already answered
        _k8_before_started,
        _k8_second_started,
        _k8_second_initial,
        _k8_wait_initial,
        _k8_terminate_initial,
    ],
    ids=[
        "unknown",
        "answered",
        "initial-first",
        "started-twice",
        "initial-twice",
        "wait",
        "terminate",
    ],
)
def test_unknown_request_ids_are_k8(setup: Callable[[ClientProtocol], HostToClient]) -> None:
    protocol = connected()
    opened(protocol)
    message = setup(protocol)
    assert isinstance(message, OperationResponse | ExecuteInitialResponse)
    violation(protocol, message, f"code-mode host returned unknown request ID {message.id}")


def test_operations_on_a_shut_down_session_are_c9() -> None:
    protocol = connected()
    opened(protocol)
    protocol.shutdown(S1)
    protocol.data_to_send()
    operations: list[Callable[[], object]] = [
        lambda: protocol.execute(S1, REQUEST),
        lambda: protocol.wait(S1, WaitRequest(CellId(CELL), 1)),
        lambda: protocol.terminate(S1, CellId(CELL)),
        lambda: protocol.shutdown(S1),
        lambda: protocol.execute("session-unknown", REQUEST),
    ]
    for operation in operations:
        with pytest.raises(CodeModeError, match=r"^code mode session is shutting down$"):
            operation()
    assert outcome(protocol) == NOTHING


# -- execute cancellation and abandonment ------------------------------------------------------------


def test_execute_cancelled_before_admission_then_refused() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.cancel(request_id)
    assert outcome(protocol) == ([], [OperationCancel(request_id)])
    protocol.cancel(request_id)  # once
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, refuse(request_id, CANCELLED)) == NOTHING
    assert protocol.pending_requests() == 0


def test_execute_cancelled_before_admission_but_admitted_anyway() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.cancel(request_id)
    protocol.data_to_send()
    assert deliver(protocol, respond(request_id, ExecutionStarted(CELL))) == (
        [],
        [OperationRequest(3, SessionTerminate(S1, CELL))],
    )
    assert deliver(protocol, initial(request_id, CELL)) == NOTHING  # discarded
    assert deliver(protocol, live(3, CELL)) == NOTHING  # the terminate's outcome is discarded too
    # cell_closed still fires exactly once.
    assert deliver(protocol, WireCellClosed(S1, CELL)) == ([CellClosed(S1, CellId(CELL))], [])
    assert protocol.pending_requests() == 0


def test_cancelled_execute_still_validates_its_initial_response() -> None:
    protocol = connected()
    opened(protocol)
    request_id = start_cell(protocol)
    protocol.cancel(request_id)
    protocol.data_to_send()
    violation(
        protocol,
        initial(request_id, "2"),
        "code-mode host returned an initial response for cell 2 instead of 1",
    )


def test_abandoned_before_admission_in_a_shutting_down_session_is_not_terminated() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.cancel(request_id)
    shutdown_id = protocol.shutdown(S1)
    assert outcome(protocol) == (
        [],
        [OperationCancel(request_id), OperationRequest(shutdown_id, SessionShutdown(S1))],
    )
    assert deliver(protocol, respond(request_id, ExecutionStarted(CELL))) == NOTHING


def test_started_cell_abandoned_before_its_initial_response() -> None:
    protocol = connected()
    opened(protocol)
    request_id = start_cell(protocol)
    protocol.abandon_cell(S1, CellId(CELL), request_id)
    assert outcome(protocol) == (
        [],
        [OperationCancel(request_id), OperationRequest(3, SessionTerminate(S1, CELL))],
    )
    protocol.abandon_cell(S1, CellId(CELL), request_id)  # idempotent
    protocol.cancel(request_id)
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, initial(request_id, CELL)) == NOTHING


def test_started_cell_abandoned_after_its_initial_response() -> None:
    protocol = connected()
    opened(protocol)
    request_id = run_cell(protocol)
    protocol.abandon_cell(S1, CellId(CELL), request_id)
    assert outcome(protocol) == ([], [OperationRequest(3, SessionTerminate(S1, CELL))])
    protocol.abandon_cell(S1, CellId(CELL), request_id)
    assert outcome(protocol) == NOTHING


def test_abandon_cell_with_a_mismatched_request_only_terminates() -> None:
    protocol = connected()
    opened(protocol)
    first = start_cell(protocol, "1")
    second = start_cell(protocol, "2")
    protocol.abandon_cell(S1, CellId("1"), second)  # the request admitted another cell
    assert outcome(protocol) == ([], [OperationRequest(4, SessionTerminate(S1, "1"))])
    # The initial responses of both are still delivered.
    assert deliver(protocol, initial(second, "2"))[0] != []
    assert deliver(protocol, initial(first, "1"))[0] != []


def test_closed_cell_is_not_terminated_on_abandonment() -> None:
    protocol = connected()
    opened(protocol)
    request_id = run_cell(protocol)
    protocol.receive(WireCellClosed(S1, CELL))
    protocol.events_received()
    protocol.abandon_cell(S1, CellId(CELL), request_id)
    assert outcome(protocol) == NOTHING


def test_abandonment_while_shutting_down_only_cancels() -> None:
    protocol = connected()
    opened(protocol)
    request_id = start_cell(protocol)
    protocol.shutdown(S1)
    protocol.data_to_send()
    protocol.abandon_cell(S1, CellId(CELL), request_id)
    assert outcome(protocol) == ([], [OperationCancel(request_id)])


def test_cancel_racing_execution_started_abandons_the_cell() -> None:
    protocol = connected()
    opened(protocol)
    request_id = start_cell(protocol)
    protocol.cancel(request_id)
    assert outcome(protocol) == (
        [],
        [OperationCancel(request_id), OperationRequest(3, SessionTerminate(S1, CELL))],
    )


def test_cancel_of_unknown_or_finished_requests_is_ignored() -> None:
    protocol = connected()
    opened(protocol)
    protocol.cancel(1)  # the answered open
    protocol.cancel(99)
    protocol.abandon_cell(S1, CellId("9"), 99)
    protocol.abandon_cell("session-9", CellId("9"), 99)
    assert outcome(protocol) == NOTHING


# -- wait ----------------------------------------------------------------------------------------


def test_wait_answers() -> None:
    protocol = connected()
    opened(protocol)
    request_id = wait(protocol, ms=250)
    assert outcome(protocol) == ([], [wait_request(request_id, ms=250)])
    assert deliver(protocol, live(request_id, CELL)) == (
        [WaitAnswered(request_id, LiveCell(Yielded(CellId(CELL), [])))],
        [],
    )
    request_id = wait(protocol, "9")
    assert deliver(protocol, missing(request_id, "9")) == (
        [WaitAnswered(request_id, MissingCell(Result(CellId("9"), [], "exec cell 9 not found")))],
        [wait_request(request_id, "9")],
    )
    request_id = wait(protocol)
    busy = "exec cell 1 already has an active observer"
    assert deliver(protocol, refuse(request_id, busy)) == (
        [OperationFailed(request_id, busy)],
        [wait_request(request_id)],
    )
    assert protocol.pending_requests() == 0


def test_wait_conversion_failure() -> None:
    protocol = connected()
    opened(protocol)
    with pytest.raises(WireConversionError):
        protocol.wait(S1, WaitRequest(CellId(CELL), -1))
    assert outcome(protocol) == NOTHING
    assert wait(protocol) == 2


@pytest.mark.parametrize("answer", [live, missing])
def test_wait_outcome_for_another_cell_is_k14(
    answer: Callable[[int, str], OperationResponse],
) -> None:
    protocol = connected()
    opened(protocol)
    request_id = wait(protocol, "1")
    protocol.data_to_send()
    text = "code-mode host returned cell 2 for request targeting 1"
    assert violation(protocol, answer(request_id, "2"), text) == [
        OperationFailed(request_id, text, connection_lost=True)
    ]


@pytest.mark.parametrize("value", [SessionReady(S1), ExecutionStarted("1"), SessionClosed(S1)])
@pytest.mark.parametrize("kind", ["wait", "terminate"])
def test_invalid_cell_response_is_k11(value: HostResponse, kind: str) -> None:
    protocol = connected()
    opened(protocol)
    request_id = wait(protocol, "1") if kind == "wait" else protocol.terminate(S1, CellId("1"))
    protocol.data_to_send()
    text = "code-mode host returned an invalid cell response"
    assert violation(protocol, respond(request_id, value), text) == [
        OperationFailed(request_id, text, connection_lost=True)
    ]


def test_cancelled_wait_discards_even_a_real_outcome() -> None:
    protocol = connected()
    opened(protocol)
    request_id = wait(protocol)
    protocol.data_to_send()
    protocol.cancel(request_id)
    assert outcome(protocol) == ([], [OperationCancel(request_id)])
    protocol.cancel(request_id)
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, live(request_id, CELL)) == NOTHING
    assert protocol.pending_requests() == 0


def test_cancelled_wait_still_validates_its_outcome() -> None:
    protocol = connected()
    opened(protocol)
    request_id = wait(protocol)
    protocol.cancel(request_id)
    protocol.data_to_send()
    assert (
        violation(
            protocol,
            live(request_id, "2"),
            f"code-mode host returned cell 2 for request targeting {CELL}",
        )
        == []
    )


def test_wait_deferred_behind_a_cancelled_wait() -> None:
    protocol = connected()
    opened(protocol)
    first = wait(protocol)
    protocol.cancel(first)
    protocol.data_to_send()
    second = wait(protocol, ms=2)
    third = wait(protocol, ms=3)
    assert outcome(protocol) == NOTHING
    assert protocol.pending_requests() == 3
    assert deliver(protocol, refuse(first, CANCELLED)) == (
        [],
        [wait_request(second, ms=2), wait_request(third, ms=3)],
    )
    assert deliver(protocol, live(second, CELL)) == (
        [WaitAnswered(second, LiveCell(Yielded(CellId(CELL), [])))],
        [],
    )


def test_answer_to_a_deferred_wait_is_k8() -> None:
    protocol = connected()
    opened(protocol)
    first = wait(protocol)
    protocol.cancel(first)
    second = wait(protocol, ms=2)
    protocol.data_to_send()
    text = f"code-mode host returned unknown request ID {second}"
    assert violation(protocol, live(second, CELL), text) == [
        OperationFailed(second, text, connection_lost=True)  # the held-back wait fails too
    ]


def test_queued_wait_cancelled_is_dropped_unsent() -> None:
    protocol = connected()
    opened(protocol)
    first = wait(protocol)
    protocol.cancel(first)
    second = wait(protocol, ms=2)
    third = wait(protocol, ms=3)
    protocol.data_to_send()
    protocol.cancel(second)
    protocol.cancel(second)
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, live(first, CELL)) == ([], [wait_request(third, ms=3)])
    protocol.cancel(third)
    assert deliver(protocol, refuse(third, CANCELLED)) == ([], [OperationCancel(third)])
    assert protocol.pending_requests() == 0


def test_only_queued_wait_cancelled_leaves_nothing_to_send() -> None:
    protocol = connected()
    opened(protocol)
    first = wait(protocol)
    protocol.cancel(first)
    second = wait(protocol, ms=2)
    protocol.cancel(second)
    protocol.data_to_send()
    assert deliver(protocol, live(first, CELL)) == NOTHING
    assert protocol.pending_requests() == 0
    # The cell is no longer deferred.
    third = wait(protocol)
    assert sent(protocol) == [wait_request(third)]


def test_wait_deferral_is_per_session_and_cell() -> None:
    protocol = connected()
    opened(protocol)
    opened(protocol)
    first = wait(protocol)
    protocol.cancel(first)
    protocol.data_to_send()
    other_cell = wait(protocol, "2")
    other_session = wait(protocol, session="session-2")
    assert sent(protocol) == [
        wait_request(other_cell, "2"),
        wait_request(other_session, session="session-2"),
    ]


def test_deferral_waits_for_every_cancelled_wait_of_the_cell() -> None:
    protocol = connected()
    opened(protocol)
    a = wait(protocol)
    b = wait(protocol)  # the host answers it "busy"
    protocol.cancel(a)
    protocol.cancel(b)
    c = wait(protocol)
    protocol.data_to_send()
    assert deliver(protocol, live(a, CELL)) == NOTHING
    assert deliver(protocol, refuse(b, "busy")) == ([], [wait_request(c)])


def test_a_terminate_is_never_deferred() -> None:
    protocol = connected()
    opened(protocol)
    first = wait(protocol)
    protocol.cancel(first)
    protocol.data_to_send()
    request_id = protocol.terminate(S1, CellId(CELL))
    assert sent(protocol) == [OperationRequest(request_id, SessionTerminate(S1, CELL))]


# -- terminate -----------------------------------------------------------------------------------


def test_terminate() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.terminate(S1, CellId(CELL))
    assert outcome(protocol) == ([], [OperationRequest(request_id, SessionTerminate(S1, CELL))])
    answer = WireWaitOutcome(live_cell=WireRuntimeResponse(terminated=WireTerminated(CELL, [])))
    assert deliver(protocol, respond(request_id, WaitCompleted(answer))) == (
        [WaitAnswered(request_id, LiveCell(Terminated(CellId(CELL), [])))],
        [],
    )
    request_id = protocol.terminate(S1, CellId("5"))
    assert deliver(protocol, refuse(request_id, "nope"))[0] == [OperationFailed(request_id, "nope")]


def test_terminate_outcome_for_another_cell_is_k14() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.terminate(S1, CellId("5"))
    protocol.data_to_send()
    violation(
        protocol,
        missing(request_id, CELL),
        "code-mode host returned cell 1 for request targeting 5",
    )


def test_cancelled_terminate_is_not_cancelled_on_the_wire() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.terminate(S1, CellId(CELL))
    protocol.data_to_send()
    protocol.cancel(request_id)
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, live(request_id, CELL)) == NOTHING
    assert protocol.pending_requests() == 0


# -- shutdown ------------------------------------------------------------------------------------


def test_shutdown() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.shutdown(S1)
    assert protocol.session_of(request_id) == S1
    assert outcome(protocol) == ([], [OperationRequest(request_id, SessionShutdown(S1))])
    assert deliver(protocol, respond(request_id, SessionClosed(S1))) == (
        [SessionShutDown(request_id, S1), SessionForgotten(S1)],
        [],
    )
    assert protocol.pending_requests() == 0


def test_cancelled_shutdown_still_forgets_the_session_silently() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.shutdown(S1)
    protocol.data_to_send()
    protocol.cancel(request_id)
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, respond(request_id, SessionClosed(S1))) == (
        [SessionForgotten(S1)],
        [],
    )


@pytest.mark.parametrize("value", [SessionClosed("session-2"), SessionReady(S1)])
def test_invalid_shutdown_response_is_k12(value: HostResponse) -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.shutdown(S1)
    protocol.data_to_send()
    text = "code-mode host returned an invalid shutdown response"
    assert violation(protocol, respond(request_id, value), text) == [
        OperationFailed(request_id, text, connection_lost=True)
    ]


def test_shutdown_error_is_k13() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.shutdown(S1)
    protocol.data_to_send()
    text = "code-mode host failed to shut down session session-1: boom"
    assert violation(protocol, refuse(request_id, "boom"), text) == [
        OperationFailed(request_id, text, connection_lost=True)
    ]


def test_shutdown_waits_for_every_cell_closed() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.events_received()
    request_id = protocol.shutdown(S1)
    protocol.data_to_send()
    assert deliver(protocol, DelegateCancel(1)) == ([CallbackCancelled(1)], [])
    assert deliver(protocol, WireCellClosed(S1, CELL)) == NOTHING  # its callback task still runs
    assert deliver(protocol, respond(request_id, SessionClosed(S1))) == NOTHING
    assert protocol.open_cells(S1) == 1
    protocol.finish_callback(1, ToolReturned(1))
    assert outcome(protocol) == (
        [CellClosed(S1, CellId(CELL)), SessionShutDown(request_id, S1), SessionForgotten(S1)],
        [],  # revoked: its answer is suppressed
    )
    assert protocol.open_cells(S1) == 0


def test_shutdown_fails_executes_awaiting_admission_with_c10() -> None:
    protocol = connected()
    opened(protocol)
    pending = execute(protocol)
    cancelled = execute(protocol)
    protocol.cancel(cancelled)
    protocol.data_to_send()
    request_id = protocol.shutdown(S1)
    assert outcome(protocol) == (
        [OperationFailed(pending, C10)],
        [OperationRequest(request_id, SessionShutdown(S1)), OperationCancel(pending)],
    )
    assert deliver(protocol, refuse(pending, CANCELLED)) == NOTHING
    assert deliver(protocol, refuse(cancelled, CANCELLED)) == NOTHING
    assert deliver(protocol, respond(request_id, SessionClosed(S1))) == (
        [SessionShutDown(request_id, S1), SessionForgotten(S1)],
        [],
    )
    assert protocol.pending_requests() == 0


def test_session_closed_fails_a_missing_initial_response_with_c10() -> None:
    protocol = connected()
    opened(protocol)
    started = start_cell(protocol)
    request_id = protocol.shutdown(S1)
    protocol.data_to_send()
    # A host that (wrongly) closes the session without the cell's initial response and cell/closed.
    assert deliver(protocol, respond(request_id, SessionClosed(S1))) == (
        [
            OperationFailed(started, C10),
            CellClosed(S1, CellId(CELL)),
            SessionShutDown(request_id, S1),
            SessionForgotten(S1),
        ],
        [],
    )


# -- callbacks -----------------------------------------------------------------------------------


def test_tool_callback_round_trip() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    assert deliver(protocol, tool_request(1)) == ([CallbackRequested(1, S1, call())], [])
    assert protocol.unresolved_callbacks() == 1
    protocol.finish_callback(1, ToolReturned({"ok": [1, None]}))
    assert outcome(protocol) == ([], [tool_result(1, {"ok": [1, None]})])
    assert protocol.unresolved_callbacks() == 0

    protocol.receive(tool_request(2))
    protocol.events_received()
    protocol.finish_callback(2, ToolReturned(None))
    queued = protocol.data_to_send()
    assert queued == [(encode_frame(tool_result(2, None)), Lane.CONTROL)]
    assert bytes(queued[0][0][4:]) == (
        b'{"type":"delegate/response","id":2,"result":{"status":"ok","value":'
        b'{"type":"tool/result","result":null}}}'
    )


def test_notification_callback_round_trip() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    assert deliver(protocol, note_request(1)) == ([CallbackRequested(1, S1, note())], [])
    protocol.finish_callback(1, NotificationAccepted())
    assert outcome(protocol) == ([], [DelegateResponseMessage(1, WireOk(NotificationDelivered()))])
    protocol.receive(note_request(2))
    protocol.events_received()
    protocol.finish_callback(2, CallbackFailed("nope"))
    assert outcome(protocol) == ([], [error_response(2, "nope")])


def test_result_shapes_follow_the_callback_kind() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(note_request(1))
    protocol.receive(tool_request(2))
    protocol.events_received()
    protocol.finish_callback(1, ToolReturned("ignored"))  # a notification is just delivered
    protocol.finish_callback(2, NotificationAccepted())  # a tool that returned nothing: null
    assert sent(protocol) == [
        DelegateResponseMessage(1, WireOk(NotificationDelivered())),
        tool_result(2, None),
    ]


def test_callback_failures_are_sent_unchanged() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.events_received()
    protocol.finish_callback(1, CallbackFailed("code-mode delegate task failed: boom"))
    assert sent(protocol) == [error_response(1, "code-mode delegate task failed: boom")]


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ({"x": object()}, "Encoding objects of type object is unsupported"),
        ([float("nan")], "nan is not a JSON number"),
        ({"x": float("-inf")}, "-inf is not a JSON number"),
    ],
)
def test_non_json_result_is_d5(value: Any, detail: str) -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.events_received()
    protocol.finish_callback(1, ToolReturned(value))
    assert sent(protocol) == [
        error_response(1, "code-mode delegate returned a value that is not JSON: " + detail)
    ]
    assert protocol.unresolved_callbacks() == 0


@pytest.mark.slow
def test_oversize_result_is_d6() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.events_received()
    protocol.finish_callback(1, ToolReturned("x" * MAX_FRAME_BYTES))
    (message,) = sent(protocol)
    assert isinstance(message, DelegateResponseMessage)
    assert isinstance(message.result, WireError)
    length = MAX_FRAME_BYTES + len(encode_frame(tool_result(1, ""))) - 4
    assert message.result.message == (
        "code-mode delegate response exceeds the IPC frame limit: "
        f"code-mode IPC frame length {length} exceeds {MAX_FRAME_BYTES} bytes"
    )
    assert protocol.is_alive()


def test_duplicate_active_delegate_id_is_k17() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.events_received()
    text = "duplicate code-mode delegate request ID 1"
    assert violation(protocol, tool_request(1), text) == [CallbackCancelled(1)]


def _dup_finished(protocol: ClientProtocol) -> int:
    protocol.receive(tool_request(1))
    protocol.finish_callback(1, ToolReturned(1))
    return 1


def _dup_revoked(protocol: ClientProtocol) -> int:
    protocol.receive(tool_request(2))
    protocol.receive(DelegateCancel(2))
    return 2


def _dup_revoked_finished(protocol: ClientProtocol) -> int:
    _dup_revoked(protocol)
    protocol.finish_callback(2, ToolReturned(1))
    return 2


def _dup_refused(protocol: ClientProtocol) -> int:
    protocol.receive(tool_request(3, cell="nope"))  # answered D3 at once
    return 3


def _dup_parked_cancelled(protocol: ClientProtocol) -> int:
    execute(protocol)
    protocol.receive(tool_request(4, cell="2"))
    protocol.receive(DelegateCancel(4))
    return 4


@pytest.mark.parametrize(
    "setup",
    [_dup_finished, _dup_revoked, _dup_revoked_finished, _dup_refused, _dup_parked_cancelled],
)
@pytest.mark.parametrize("again", [tool_request, note_request])
def test_duplicate_delegate_ids_are_k17(
    setup: Callable[[ClientProtocol], int], again: Callable[[int], DelegateRequestMessage]
) -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    delegate_id = setup(protocol)
    protocol.events_received()
    protocol.data_to_send()
    violation(
        protocol, again(delegate_id), f"duplicate code-mode delegate request ID {delegate_id}"
    )


def test_only_the_last_4096_finished_delegate_ids_are_remembered() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    for delegate_id in range(1, RECENT_ID_MEMORY + 2):
        protocol.receive(tool_request(delegate_id))
        protocol.finish_callback(delegate_id, ToolReturned(None))
    protocol.events_received()
    protocol.data_to_send()
    assert deliver(protocol, tool_request(1)) == ([CallbackRequested(1, S1, call())], [])
    violation(protocol, tool_request(2), "duplicate code-mode delegate request ID 2")


def test_pending_callback_cap_is_d1() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    for delegate_id in range(1, 1025):
        protocol.receive(tool_request(delegate_id))
    assert len(protocol.events_received()) == 1024
    assert protocol.unresolved_callbacks() == 1024
    assert deliver(protocol, tool_request(1025)) == ([], [error_response(1025, D1)])
    # The cap comes before the session check.
    assert deliver(protocol, note_request(1026, session="nope")) == (
        [],
        [error_response(1026, D1)],
    )
    # A revoked callback no longer counts, even while its task runs.
    assert deliver(protocol, DelegateCancel(1)) == ([CallbackCancelled(1)], [])
    assert protocol.unresolved_callbacks() == 1023
    assert deliver(protocol, tool_request(1027)) == ([CallbackRequested(1027, S1, call())], [])
    assert deliver(protocol, note_request(1028)) == ([], [error_response(1028, D1)])
    # A finished callback frees its slot too.
    protocol.finish_callback(2, ToolReturned(None))
    assert sent(protocol) == [tool_result(2, None)]
    assert deliver(protocol, note_request(1029)) == ([CallbackRequested(1029, S1, note())], [])
    violation(protocol, tool_request(1025), "duplicate code-mode delegate request ID 1025")


def test_parked_callbacks_count_against_the_cap() -> None:
    protocol = connected()
    opened(protocol)
    execute(protocol)
    for delegate_id in range(1, 1025):
        assert deliver(protocol, tool_request(delegate_id)) == NOTHING
    assert protocol.unresolved_callbacks() == 1024
    assert deliver(protocol, tool_request(1025)) == ([], [error_response(1025, D1)])


def test_unknown_session_is_d2() -> None:
    protocol = connected()
    text = "code-mode host delegated for unknown session {}"
    assert deliver(protocol, tool_request(1, session="nope")) == (
        [],
        [error_response(1, text.format("nope"))],
    )
    request_id = protocol.open_session()
    protocol.data_to_send()
    assert deliver(protocol, tool_request(2, session=S1)) == (
        [],
        [error_response(2, text.format(S1))],  # still opening
    )
    protocol.receive(respond(request_id, SessionReady(S1)))
    shutdown_id = protocol.shutdown(S1)
    protocol.receive(respond(shutdown_id, SessionClosed(S1)))
    protocol.events_received()
    protocol.data_to_send()
    assert deliver(protocol, note_request(3, session=S1)) == (
        [],
        [error_response(3, text.format(S1))],  # closed
    )
    assert protocol.unresolved_callbacks() == 0


def test_callback_while_shutting_down_is_still_served() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.shutdown(S1)
    protocol.data_to_send()
    assert deliver(protocol, note_request(1)) == ([CallbackRequested(1, S1, note())], [])


def test_unknown_cell_is_d3() -> None:
    protocol = connected()
    opened(protocol)
    text = "code-mode host delegated for unknown cell 5 in session session-1"
    assert deliver(protocol, tool_request(1, cell="5")) == ([], [error_response(1, text)])
    run_cell(protocol, "5")
    protocol.receive(WireCellClosed(S1, "5"))
    protocol.events_received()
    assert deliver(protocol, note_request(2, cell="5")) == ([], [error_response(2, text)])
    assert deliver(protocol, DelegateCancel(2)) == NOTHING  # a late cancel is ignored


def test_early_callback_is_parked_until_its_cell_starts() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    assert deliver(protocol, tool_request(1)) == NOTHING
    assert deliver(protocol, note_request(2)) == NOTHING
    assert protocol.unresolved_callbacks() == 2
    with pytest.raises(LocalProtocolError, match=r"^callback 1 is not running$"):
        protocol.finish_callback(1, ToolReturned(None))
    assert deliver(protocol, respond(request_id, ExecutionStarted(CELL))) == (
        [
            CellStarted(request_id, S1, CellId(CELL)),
            CallbackRequested(1, S1, call()),
            CallbackRequested(2, S1, note()),
        ],
        [],
    )
    assert protocol.unresolved_callbacks() == 2
    protocol.finish_callback(1, ToolReturned(None))
    assert sent(protocol) == [tool_result(1, None)]


def test_parked_callback_for_another_cell_is_d3_once_nothing_awaits_admission() -> None:
    protocol = connected()
    opened(protocol)
    first = execute(protocol)
    second = execute(protocol)
    protocol.receive(tool_request(1, cell="2"))
    protocol.receive(tool_request(3, cell="9"))
    assert deliver(protocol, respond(first, ExecutionStarted(CELL))) == (
        [CellStarted(first, S1, CellId(CELL))],
        [],
    )
    assert deliver(protocol, respond(second, ExecutionStarted("2"))) == (
        [CellStarted(second, S1, CellId("2")), CallbackRequested(1, S1, call("2"))],
        [error_response(3, "code-mode host delegated for unknown cell 9 in session session-1")],
    )
    assert protocol.unresolved_callbacks() == 1


def test_parked_callback_refused_when_the_execute_fails() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.receive(tool_request(1))
    cells = "code-mode host has too many active cells"
    assert deliver(protocol, refuse(request_id, cells)) == (
        [OperationFailed(request_id, cells)],
        [error_response(1, "code-mode host delegated for unknown cell 1 in session session-1")],
    )
    assert protocol.unresolved_callbacks() == 0
    violation(protocol, tool_request(1), "duplicate code-mode delegate request ID 1")


def test_parked_callbacks_wait_for_every_admitting_execute() -> None:
    protocol = connected()
    opened(protocol)
    first = execute(protocol)
    second = execute(protocol)
    protocol.receive(tool_request(1, cell="2"))
    assert deliver(protocol, refuse(first, "no")) == ([OperationFailed(first, "no")], [])
    assert deliver(protocol, respond(second, ExecutionStarted("2"))) == (
        [CellStarted(second, S1, CellId("2")), CallbackRequested(1, S1, call("2"))],
        [],
    )


def test_parking_is_per_session() -> None:
    protocol = connected()
    opened(protocol)
    opened(protocol)
    execute(protocol, "session-2")
    text = "code-mode host delegated for unknown cell 1 in session session-1"
    assert deliver(protocol, tool_request(1)) == ([], [error_response(1, text)])


def test_cancel_of_a_parked_callback_removes_it_silently() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.receive(tool_request(1))
    assert deliver(protocol, DelegateCancel(1)) == NOTHING
    assert protocol.unresolved_callbacks() == 0
    assert deliver(protocol, respond(request_id, ExecutionStarted(CELL))) == (
        [CellStarted(request_id, S1, CellId(CELL))],
        [],
    )
    with pytest.raises(LocalProtocolError, match=r"^callback 1 is not running$"):
        protocol.finish_callback(1, ToolReturned(None))
    violation(protocol, tool_request(1), "duplicate code-mode delegate request ID 1")


def test_delegate_cancel_suppresses_the_response() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.events_received()
    assert deliver(protocol, DelegateCancel(1)) == ([CallbackCancelled(1)], [])
    assert protocol.unresolved_callbacks() == 0
    assert deliver(protocol, DelegateCancel(1)) == NOTHING
    assert deliver(protocol, DelegateCancel(77)) == NOTHING  # unknown: ignored
    protocol.finish_callback(1, ToolReturned("late"))
    assert outcome(protocol) == NOTHING
    assert deliver(protocol, DelegateCancel(1)) == NOTHING  # finished: ignored
    with pytest.raises(LocalProtocolError, match=r"^callback 1 is not running$"):
        protocol.finish_callback(1, ToolReturned("again"))


def test_cell_closed_revokes_callbacks_and_fires_once_after_them() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.receive(note_request(2))
    protocol.receive(tool_request(3))
    protocol.receive(DelegateCancel(3))
    protocol.events_received()
    assert deliver(protocol, WireCellClosed(S1, CELL)) == (
        [CallbackCancelled(1), CallbackCancelled(2)],
        [],
    )
    assert protocol.open_cells(S1) == 1
    assert protocol.unresolved_callbacks() == 0
    protocol.finish_callback(2, NotificationAccepted())
    assert outcome(protocol) == NOTHING
    protocol.finish_callback(3, ToolReturned(None))
    assert outcome(protocol) == NOTHING
    protocol.finish_callback(1, ToolReturned(None))
    assert outcome(protocol) == ([CellClosed(S1, CellId(CELL))], [])
    assert protocol.open_cells(S1) == 0
    violation(
        protocol,
        WireCellClosed(S1, CELL),
        "code-mode host closed unknown cell 1 in session session-1",
    )


def test_callback_for_a_closed_cell_with_running_tasks_is_d3() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.receive(WireCellClosed(S1, CELL))
    protocol.events_received()
    text = "code-mode host delegated for unknown cell 1 in session session-1"
    assert deliver(protocol, tool_request(2)) == ([], [error_response(2, text)])


@pytest.mark.parametrize(
    ("session", "cell", "text"),
    [
        (S1, "4", "code-mode host closed unknown cell 4 in session session-1"),
        ("session-7", "1", "code-mode host closed unknown cell 1 in session session-7"),
    ],
)
def test_cell_closed_for_unknown_cells_is_k18(session: str, cell: str, text: str) -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    assert violation(protocol, WireCellClosed(session, cell), text) == [
        CellClosed(S1, CellId(CELL))
    ]


def test_finish_of_an_unknown_callback_is_a_local_error() -> None:
    protocol = connected()
    with pytest.raises(LocalProtocolError, match=r"^callback 1 is not running$"):
        protocol.finish_callback(1, ToolReturned(None))
    assert protocol.is_alive()


# -- connection errors and death ---------------------------------------------------------------------


ENDINGS: Final[list[tuple[str, Callable[[ClientProtocol], None], str]]] = [
    ("close", lambda p: p.close(), K1),
    ("eof", lambda p: p.receive_eof(), K1),
    ("exit", lambda p: p.host_exited(1), "code-mode host exited with status 1"),
    ("signal", lambda p: p.host_exited(-9), "code-mode host exited with status -9"),
    ("read", lambda p: p.read_failed("reset"), "failed to read code-mode host message: reset"),
    ("write", lambda p: p.write_failed("pipe"), "failed to write code-mode host message: pipe"),
    ("text", lambda p: p.text_received(), "code-mode host sent a text WebSocket message"),
    (
        "bulk",
        lambda p: p.bulk_failed("gone"),
        "code-mode host bulk connection is unavailable: gone",
    ),
]


@pytest.mark.parametrize(
    ("end", "text"),
    [(end, text) for _, end, text in ENDINGS],
    ids=[name for name, _, _ in ENDINGS],
)
@pytest.mark.parametrize("dual", [False, True])
def test_connection_errors_after_the_handshake(
    end: Callable[[ClientProtocol], None], text: str, dual: bool
) -> None:
    protocol = connected(dual=dual)
    opened(protocol)
    request_id = execute(protocol)
    end(protocol)
    assert ended(protocol, text) == [OperationFailed(request_id, text, connection_lost=True)]
    with pytest.raises(ConnectionClosed, match=exactly(text)):
        protocol.open_session()


@pytest.mark.parametrize(
    ("end", "text"),
    [(end, text) for _, end, text in ENDINGS],
    ids=[name for name, _, _ in ENDINGS],
)
def test_connection_errors_while_pairing(end: Callable[[ClientProtocol], None], text: str) -> None:
    protocol = ClientProtocol(dual_websocket=True)
    protocol.receive(ready(dual=True))
    protocol.events_received()
    end(protocol)
    assert ended(protocol, text) == []


def test_the_first_failure_wins() -> None:
    protocol = connected()
    opened(protocol)
    request_id = execute(protocol)
    protocol.read_failed("reset")
    first = "failed to read code-mode host message: reset"
    assert ended(protocol, first) == [OperationFailed(request_id, first, connection_lost=True)]
    protocol.host_exited(1)
    protocol.close()
    protocol.write_failed("x")
    protocol.text_received()
    protocol.bulk_failed("x")
    protocol.timed_out()
    protocol.receive_eof()
    protocol.receive(WireCellClosed(S1, CELL))
    protocol.receive_data(b"garbage")
    protocol.receive_frame(b"")
    assert outcome(protocol) == NOTHING
    assert protocol.failure == first


def test_a_host_violation_after_a_failure_changes_nothing() -> None:
    protocol = connected()
    protocol.close()
    protocol.events_received()
    protocol.receive(respond(99, SessionReady(S1)))
    assert protocol.failure == K1
    assert outcome(protocol) == NOTHING


def test_the_end_fails_everything_once() -> None:
    protocol = connected()
    opened(protocol)
    open_id = protocol.open_session()
    protocol.data_to_send()
    admitting = execute(protocol)
    started = start_cell(protocol, "2")
    cancelled_wait = wait(protocol)
    protocol.cancel(cancelled_wait)
    queued = wait(protocol)
    terminate = protocol.terminate(S1, CellId("2"))
    protocol.data_to_send()
    run_cell(protocol, "3")
    protocol.receive(tool_request(1, cell="3"))
    protocol.receive(tool_request(2, cell="9"))  # parked behind the admitting execute
    protocol.events_received()
    reason = "code-mode host exited with status 1"
    protocol.host_exited(1)
    assert ended(protocol, reason) == [
        OperationFailed(open_id, reason, connection_lost=True),
        OperationFailed(admitting, reason, connection_lost=True),
        OperationFailed(started, reason, connection_lost=True),
        OperationFailed(queued, reason, connection_lost=True),
        OperationFailed(terminate, reason, connection_lost=True),
        CellClosed(S1, CellId("2")),
        CallbackCancelled(1),
    ]
    assert sent(protocol) == []  # the held-back wait is never sent
    assert protocol.pending_requests() == 0
    assert protocol.unresolved_callbacks() == 0
    assert protocol.open_cells(S1) == 1
    protocol.close()
    assert outcome(protocol) == NOTHING
    assert protocol.failure == reason
    # The running callback's answer is suppressed; its cell then closes.
    protocol.finish_callback(1, ToolReturned(None))
    assert outcome(protocol) == ([CellClosed(S1, CellId("3"))], [])
    assert protocol.open_cells(S1) == 0
    with pytest.raises(LocalProtocolError, match=r"^callback 2 is not running$"):
        protocol.finish_callback(2, ToolReturned(None))  # the parked one is gone
    operations: list[Callable[[], object]] = [
        protocol.open_session,
        lambda: protocol.execute(S1, REQUEST),
        lambda: protocol.wait(S1, WaitRequest(CellId(CELL), 1)),
        lambda: protocol.terminate(S1, CellId(CELL)),
        lambda: protocol.shutdown(S1),
    ]
    for operation in operations:
        with pytest.raises(ConnectionClosed, match=exactly(reason)):
            operation()
    protocol.cancel(started)
    protocol.cancel(queued)
    protocol.abandon_cell(S1, CellId("2"), started)
    protocol.abandon_cell(S1, CellId("3"), started)
    assert outcome(protocol) == NOTHING


def test_the_end_fails_a_pending_shutdown() -> None:
    protocol = connected()
    opened(protocol)
    request_id = protocol.shutdown(S1)
    protocol.data_to_send()
    protocol.write_failed("x")
    text = "failed to write code-mode host message: x"
    assert ended(protocol, text) == [OperationFailed(request_id, text, connection_lost=True)]


def test_the_end_skips_cancelled_requests() -> None:
    protocol = connected()
    open_id = protocol.open_session()
    protocol.cancel(open_id)
    protocol.close()
    assert ended(protocol, K1) == []


def test_what_was_queued_before_the_end_is_still_there_to_write() -> None:
    protocol = connected()
    opened(protocol)
    run_cell(protocol)
    protocol.receive(tool_request(1))
    protocol.receive(note_request(2, session="nope"))
    protocol.events_received()
    protocol.read_failed("x")
    protocol.finish_callback(1, ToolReturned(1))  # revoked by the end: nothing more
    assert sent(protocol) == [
        error_response(2, "code-mode host delegated for unknown session nope")
    ]


def test_request_id_exhaustion_is_k19() -> None:
    protocol = connected(first_request_id=I64_MAX)
    request_id = protocol.open_session()
    assert request_id == I64_MAX
    protocol.data_to_send()
    protocol.receive(respond(request_id, SessionReady(S1)))
    protocol.events_received()
    text = K19
    with pytest.raises(LocalProtocolError, match=exactly(text)):
        protocol.execute(S1, REQUEST)
    assert ended(protocol, text) == []
    assert sent(protocol) == []
    with pytest.raises(ConnectionClosed, match=exactly(text)):
        protocol.open_session()


def test_request_id_exhaustion_fails_what_is_pending() -> None:
    protocol = connected(first_request_id=I64_MAX - 1)
    opened(protocol)
    wait_id = wait(protocol)
    protocol.data_to_send()
    assert wait_id == I64_MAX
    text = K19
    with pytest.raises(LocalProtocolError, match=exactly(text)):
        protocol.open_session()
    assert ended(protocol, text) == [OperationFailed(wait_id, text, connection_lost=True)]
    assert sent(protocol) == []


def test_request_id_exhaustion_inside_receive_ends_the_connection_without_raising() -> None:
    protocol = connected(first_request_id=I64_MAX)
    request_id = protocol.open_session()
    protocol.cancel(request_id)
    protocol.data_to_send()
    protocol.receive(respond(request_id, SessionReady(S1)))  # raises today
    assert ended(protocol, K19) == []


def test_request_id_exhaustion_inside_cancel_ends_the_connection_without_raising() -> None:
    protocol = connected(first_request_id=I64_MAX - 1)
    opened(protocol)
    request_id = start_cell(protocol)
    protocol.cancel(request_id)  # raises today
    assert ended(protocol, K19) == [CellClosed(S1, CellId(CELL))]
    assert sent(protocol) == [OperationCancel(request_id)]
