"""Whole V1 conversations between a real :class:`ClientProtocol` and a real :class:`HostProtocol`.

Every conversation runs on a :class:`~tests.protocol.v1.pair.Pair` (no sockets, no event loop):
handshakes, sessions, nested callbacks, cancellation races, lane reordering on a dual connection,
and every error path of both ends, each compared with the exact text of
:mod:`codemode.protocol.v1.texts`. The last test checks that every text of that module was produced
by the machines in these conversations.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import typing
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec
import pytest

from codemode.errors import CodeModeError, ConnectionClosed, LocalProtocolError
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    I64_MAX,
    MAX_FRAME_BYTES,
    MAX_PENDING_DELEGATE_CALLS,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.delegation import (
    CallbackFailed,
    NotificationAccepted,
    ToolReturned,
    callback_failure,
)
from codemode.protocol.texts import (
    SESSION_SHUTTING_DOWN,
    delegate_result_not_json,
    delegate_task_failed,
    notification_not_delivered,
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
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1 import messages as wire
from codemode.protocol.v1 import texts
from codemode.protocol.v1.client import ClientProtocol
from codemode.protocol.v1.codec import encode_frame
from codemode.protocol.v1.host import HostProtocol
from codemode.protocol.v1.lanes import Lane
from tests.protocol.v1.pair import BULK_TOKEN, Pair, Recorder

T = TypeVar("T")
Scenario = Callable[[Recorder], None]

LIMITS: Final = SESSION_RESOURCE_LIMITS_CAPABILITY
DUAL: Final = DUAL_WEBSOCKET_CAPABILITY

#: Every conversation of this module, by name; the coverage test runs them all.
SCENARIOS: list[Scenario] = []


def scenario(function: Scenario) -> Scenario:
    SCENARIOS.append(function)
    return function


# -- helpers ---------------------------------------------------------------------------------------


def request(source: str = "done") -> ExecuteRequest:
    return ExecuteRequest("call-1", source, yield_time_ms=100, max_output_tokens=1000)


def wait_for(cell: str) -> WaitRequest:
    return WaitRequest(CellId(cell), 100)


def invocation(cell: str, value: Any = 1) -> CodeModeNestedToolCall:
    return CodeModeNestedToolCall(
        CellId(cell), "tool-call-1", ToolName("echo"), CodeModeToolKind.FUNCTION, {"v": value}
    )


def take(inbox: list[Any], kind: type[T]) -> T:
    """Remove and return the first event of ``kind`` from ``inbox``."""
    for index, event in enumerate(inbox):
        if isinstance(event, kind):
            del inbox[index]
            return event
    raise AssertionError(f"no {kind.__name__} in {inbox!r}")


def one(events: list[T]) -> T:
    assert len(events) == 1, events
    return events[0]


def open_session(pair: Pair) -> str:
    request_id = pair.client.open_session()
    pair.run()
    opened = [e for e in pair.client_of(ev.SessionOpened) if e.request_id == request_id]
    return one(opened).session_id


def start(pair: Pair, session: str, source: str = "yield") -> tuple[int, str]:
    """Execute ``source``; the request id and the admitted cell."""
    request_id = pair.client.execute(session, request(source))
    pair.run()
    started = [e for e in pair.client_of(ev.CellStarted) if e.request_id == request_id]
    return request_id, one(started).cell_id.value


def failed(pair: Pair, request_id: int) -> ev.OperationFailed:
    return one([e for e in pair.client_of(ev.OperationFailed) if e.request_id == request_id])


def last(pair: Pair) -> ev.ClientEvent:
    """The client's latest event."""
    return pair.client_events[-1]


def client_ended(pair: Pair, reason: str) -> None:
    """The client connection ended with ``reason`` (and only once)."""
    assert pair.client.failure == reason
    assert not pair.client.is_alive()
    assert pair.client_of(ev.ConnectionEnded) == [ev.ConnectionEnded(reason)]


def host_ended(pair: Pair, reason: str | None, requests: tuple[int, ...] = ()) -> None:
    assert pair.host.ended
    assert pair.host.failure == reason
    assert pair.host_of(ev.ConnectionEnded) == [ev.ConnectionEnded(reason, requests)]


def sent_to_host(pair: Pair, kind: type[T]) -> list[T]:
    return [message for message, _ in pair.to_host if isinstance(message, kind)]


def requests_to_host(pair: Pair, kind: type[T]) -> list[T]:
    return [
        message.request
        for message, _ in pair.to_host
        if isinstance(message, wire.OperationRequest) and isinstance(message.request, kind)
    ]


# -- handshake ---------------------------------------------------------------------------------------


@scenario
def handshake_single(recorder: Recorder) -> None:
    """A byte stream, fed one byte at a time: the grant has no bulk token."""
    pair = Pair(recorder, chunk=1)
    granted = pair.client.negotiated
    assert granted.capabilities == {LIMITS}
    assert granted.bulk_connection_token is None
    assert not granted.dual_websocket
    assert pair.client_events == [ev.HandshakeComplete(granted)]
    assert pair.host_events == [ev.HandshakeComplete(granted)]
    assert pair.host.negotiated == granted
    assert [lane for _, lane in [*pair.to_host, *pair.to_client]] == [Lane.CONTROL] * 2
    session = open_session(pair)
    assert session == "session-1"


@scenario
def handshake_dual(recorder: Recorder) -> None:
    """Dual: operations wait for the bulk socket; every frame then travels on its lane."""
    pair = Pair(recorder, dual=True, auto_bulk=False)
    granted = pair.client.negotiated
    assert granted.capabilities == {LIMITS, DUAL}
    assert granted.bulk_connection_token == BULK_TOKEN
    assert pair.client.handshaken
    error = pair.raises(LocalProtocolError, pair.client.open_session)
    assert "handshake (and bulk pairing) must complete" in error.message
    pair.client.bulk_opened()
    pair.client.bulk_opened()  # idempotent
    session = open_session(pair)
    _, cell = start(pair, session)
    pair.host.start_tool_call(session, invocation(cell))
    pair.host.start_notification(session, "call-1", CellId(cell), "note")
    pair.run()
    lanes_to_client = [(type(m).__name__, lane) for m, lane in pair.to_client[-2:]]
    assert lanes_to_client == [
        ("DelegateRequestMessage", Lane.BULK),
        ("DelegateRequestMessage", Lane.CONTROL),
    ]
    answers = [
        (m.result, lane) for m, lane in pair.to_host if isinstance(m, wire.DelegateResponseMessage)
    ]
    assert answers == [
        (wire.WireOk(wire.ToolResult({"echo": {"v": 1}})), Lane.BULK),
        (wire.WireOk(wire.NotificationDelivered()), Lane.CONTROL),
    ]
    assert {lane for m, lane in pair.to_host if isinstance(m, wire.OperationRequest)} == {
        Lane.CONTROL
    }


def _rejected(recorder: Recorder, hello: wire.ClientToHost, reason: str) -> None:
    pair = Pair(recorder, connect=False)
    pair.rewrite_to_host = lambda message: hello
    pair.run()
    client_ended(pair, texts.handshake_rejected(reason))
    host_ended(pair, None)  # a rejection is a clean end: the reply is the last frame
    assert pair.host.negotiated is None
    assert not pair.client.handshaken
    error = pair.raises(ConnectionClosed, pair.client.open_session)
    assert error.message == texts.handshake_rejected(reason)


@scenario
def handshake_rejections(recorder: Recorder) -> None:
    """C4 with each reject reason of the host."""
    _rejected(
        recorder,
        wire.OperationCancel(1),
        texts.invalid_hello(texts.FIRST_MESSAGE_MUST_BE_HELLO),
    )
    _rejected(recorder, wire.ConnectionHello((2, 3), (), ()), texts.no_compatible_version("1"))
    _rejected(
        recorder,
        wire.ConnectionHello((1,), ("x-required",), (LIMITS,)),
        texts.missing_required_capability("x-required"),
    )


def _invalid_reply(
    recorder: Recorder,
    reply: wire.HostToClient | None,
    detail: str,
    *,
    dual: bool = False,
    raw: bytes | bytearray | None = None,
) -> None:
    pair = Pair(recorder, connect=False, dual=dual)
    if reply is not None:
        pair.rewrite_to_client = lambda message: reply
        pair.run()
    else:
        assert raw is not None
        pair.hold(Lane.CONTROL, to="client")
        pair.run()
        pair.inject_bytes("client", raw)
    client_ended(pair, texts.invalid_handshake_reply(detail))
    assert not pair.client.handshaken


@scenario
def handshake_invalid_replies(recorder: Recorder) -> None:
    """C5 for every check of the reply, and for a reply that cannot be read."""
    _invalid_reply(
        recorder, wire.CellClosed("s", "c"), "expected connection/ready, got cell/closed"
    )
    _invalid_reply(
        recorder,
        wire.ConnectionReady(2, ()),
        "host selected unsupported protocol version 2",
    )
    _invalid_reply(
        recorder,
        wire.ConnectionReady(1, ("x-extra",)),
        "host granted unrequested capability `x-extra`",
    )
    _invalid_reply(
        recorder,
        wire.ConnectionReady(1, (), "token"),
        f"bulkConnectionToken without `{DUAL}`",
    )
    _invalid_reply(
        recorder, wire.ConnectionReady(1, (DUAL,)), "bulkConnectionToken is missing", dual=True
    )
    _invalid_reply(
        recorder,
        None,
        "failed to decode code-mode IPC frame: Object missing required field `type`",
        raw=encode_frame({}),
    )


@scenario
def handshake_interrupted(recorder: Recorder) -> None:
    """C2 on a timeout, C3 for whatever else ends a connection before the host answered."""
    ends: list[Callable[[Pair], None]] = [
        lambda pair: pair.client.timed_out(),
        lambda pair: pair.client.host_exited(1),
        lambda pair: pair.client.read_failed("connection reset"),
        lambda pair: pair.client.write_failed("broken pipe"),
        lambda pair: pair.client.text_received(),
        lambda pair: pair.client.close(),
        lambda pair: pair.eof("client"),
    ]
    for index, end in enumerate(ends):
        pair = Pair(recorder, connect=False)
        pair.hold(Lane.CONTROL, to="client")
        pair.run()
        end(pair)
        pair.run()
        reason = texts.HANDSHAKE_TIMED_OUT if index == 0 else texts.HOST_EXITED_DURING_HANDSHAKE
        client_ended(pair, reason)
        pair.release(Lane.CONTROL, to="client")  # the reply arrives too late
        assert not pair.client.handshaken
        pair.client.timed_out()  # the first failure stays
        assert pair.client.failure == reason
    pair = Pair(recorder)
    pair.client.timed_out()  # no effect once the handshake completed
    assert pair.client.is_alive()


@scenario
def bulk_pairing_failures(recorder: Recorder) -> None:
    """C6 on the client, L9 on the host."""
    pair = Pair(recorder, dual=True, auto_bulk=False)
    pair.client.bulk_failed("HTTP 404")
    pair.run()
    client_ended(pair, texts.bulk_unavailable("HTTP 404"))
    pair.host.bulk_not_established()
    pair.run()
    host_ended(pair, texts.BULK_NOT_ESTABLISHED)


@scenario
def limits_not_negotiated(recorder: Recorder) -> None:
    """C7 on the client; H9 from a host that did not grant limits but was sent some anyway."""
    pair = Pair(recorder, host=HostProtocol(capabilities=()))
    assert not pair.client.negotiated.resource_limits
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=50)
    error = pair.raises(CodeModeError, pair.client.open_session, limits)
    assert error.message == texts.HOST_LACKS_LIMITS
    assert pair.client.pending_requests() == 0
    assert open_session(pair) == "session-1"  # default limits need no capability

    def add_limits(message: wire.ClientToHost) -> wire.ClientToHost:
        if isinstance(message, wire.OperationRequest) and isinstance(
            message.request, wire.SessionOpen
        ):
            body = wire.SessionOpen(
                message.request.session_id, wire.WireSessionCellExecutionLimits(50)
            )
            return wire.OperationRequest(message.id, body)
        return message

    pair.rewrite_to_host = add_limits
    request_id = pair.client.open_session()
    pair.run()
    assert failed(pair, request_id) == ev.OperationFailed(request_id, texts.LIMITS_NOT_NEGOTIATED)
    assert last(pair) == ev.SessionForgotten("session-2")
    assert pair.client.is_alive()


@scenario
def limits_negotiated(recorder: Recorder) -> None:
    pair = Pair(recorder)
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=50, max_heap_size_bytes=1 << 20)
    open_session(pair)
    pair.client.open_session(limits)
    pair.run()
    assert pair.host_of(ev.OpenSession)[-1].limits == limits
    assert pair.host_of(ev.OpenSession)[0].limits == CodeModeSessionCellExecutionLimits()


# -- sessions ----------------------------------------------------------------------------------------


def _conversation(pair: Pair) -> None:
    session = open_session(pair)
    assert pair.host_of(ev.OpenSession) == [
        ev.OpenSession(1, session, CodeModeSessionCellExecutionLimits())
    ]
    # A cell that completes at once.
    request_id, cell = start(pair, session, "done")
    assert pair.client_events[-2:] == [
        ev.InitialResponse(request_id, Result(CellId(cell), [InputText("done")], None)),
        ev.CellClosed(session, CellId(cell)),
    ]
    # A cell that yields, then completes on a wait.
    request_id, cell = start(pair, session, "yield")
    assert last(pair) == ev.InitialResponse(request_id, Yielded(CellId(cell), [InputText("y")]))
    assert pair.client.open_cells(session) == 1
    wait_id = pair.client.wait(session, wait_for(cell))
    pair.run()
    assert pair.client_events[-2:] == [
        ev.WaitAnswered(wait_id, LiveCell(Result(CellId(cell), [InputText("w")]))),
        ev.CellClosed(session, CellId(cell)),
    ]
    # A wait for a cell that is gone.
    wait_id = pair.client.wait(session, wait_for(cell))
    pair.run()
    assert last(pair) == ev.WaitAnswered(wait_id, MissingCell(Terminated(CellId(cell))))
    # A cell that is terminated.
    _, cell = start(pair, session, "yield")
    terminate_id = pair.client.terminate(session, CellId(cell))
    pair.run()
    assert pair.client_events[-2:] == [
        ev.WaitAnswered(terminate_id, LiveCell(Terminated(CellId(cell)))),
        ev.CellClosed(session, CellId(cell)),
    ]
    # Shutdown with a live cell: its cell/closed comes first.
    _, cell = start(pair, session, "yield")
    shutdown_id = pair.client.shutdown(session)
    pair.run()
    assert pair.client_events[-3:] == [
        ev.CellClosed(session, CellId(cell)),
        ev.SessionShutDown(shutdown_id, session),
        ev.SessionForgotten(session),
    ]
    error = pair.raises(CodeModeError, pair.client.execute, session, request())
    assert error.message == SESSION_SHUTTING_DOWN
    assert pair.client.pending_requests() == 0
    assert pair.client.open_cells(session) == 0
    assert pair.client.unresolved_callbacks() == 0
    assert pair.host.active_cells == 0
    assert pair.host.pending_callbacks == 0
    assert not any(pair.host.in_flight(i) for i in range(1, 20))
    assert pair.client.is_alive()
    assert not pair.host.ended
    assert not pair.client_of(ev.OperationFailed)


@scenario
def conversation_single(recorder: Recorder) -> None:
    _conversation(Pair(recorder, chunk=7))


@scenario
def conversation_single_websocket(recorder: Recorder) -> None:
    _conversation(Pair(recorder, websocket=True))


@scenario
def conversation_dual(recorder: Recorder) -> None:
    _conversation(Pair(recorder, dual=True))


@scenario
def conversation_dual_streams(recorder: Recorder) -> None:
    _conversation(Pair(recorder, dual=True, websocket=False, chunk=5))


@scenario
def conversation_end(recorder: Recorder) -> None:
    """The host stream ends: K1 for everything pending, live cells close, callbacks are revoked."""
    pair = Pair(recorder, manual_client={ev.CallbackRequested})
    session = open_session(pair)
    _, cell = start(pair, session)
    pair.host.start_tool_call(session, invocation(cell))
    pair.manual_host.add(ev.StartWait)
    wait_id = pair.client.wait(session, wait_for(cell))
    pair.run()
    callback = take(pair.client_inbox, ev.CallbackRequested)
    pair.eof("client")
    client_ended(pair, texts.HOST_CONNECTION_CLOSED)
    # The running callback is revoked; its cell closes once its task ended.
    assert pair.client_events[-4:] == [
        ev.ConnectionEnded(texts.HOST_CONNECTION_CLOSED),
        ev.OperationFailed(wait_id, texts.HOST_CONNECTION_CLOSED, connection_lost=True),
        ev.CallbackCancelled(callback.delegate_id),
        ev.CellClosed(session, CellId(cell)),
    ]
    assert pair.client.open_cells(session) == 0
    error = pair.raises(ConnectionClosed, pair.client.execute, session, request())
    assert error.message == texts.HOST_CONNECTION_CLOSED
    # The host side ends on its own: the client's stream ended too.
    pair.eof("host")
    host_ended(pair, None, (wait_id,))
    assert pair.resolved == {callback.delegate_id: CallbackFailed(texts.CLIENT_CONNECTION_CLOSED)}


@scenario
def wire_revision_latest(recorder: Recorder) -> None:
    """``latest`` on both ends: the host's durations reach the client."""
    ticks = itertools.count(0, 1000)
    host = HostProtocol(wire_revision="latest", clock=lambda: next(ticks))
    pair = Pair(recorder, host=host, client=ClientProtocol(wire_revision="latest"))
    session = open_session(pair)
    request_id, _ = start(pair, session, "done")
    response = one([e for e in pair.client_of(ev.InitialResponse) if e.request_id == request_id])
    assert response.response.host_duration_ns == 1000
    assert isinstance(response.response, Result)
    assert response.response.result_buffered_for_ns == 0


@scenario
def wire_revision_mismatch(recorder: Recorder) -> None:
    """A ``latest`` host and a ``pinned`` client: K3 at the first timed response."""
    pair = Pair(recorder, host=HostProtocol(wire_revision="latest", clock=lambda: 5))
    session = open_session(pair)
    request_id = pair.client.execute(session, request("done"))
    pair.run()
    detail = (
        "failed to decode code-mode IPC frame: Object contains unknown field "
        "`result_buffered_for_ns` - at `$.result.value.Result`"
    )
    client_ended(pair, texts.host_read_failed(detail))
    assert failed(pair, request_id).connection_lost


# -- callbacks ---------------------------------------------------------------------------------------


@scenario
def nested_tool_calls_and_notifications(recorder: Recorder) -> None:
    """Callbacks issued before admission wait for execution/started; both kinds are answered."""
    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request("yield"))
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    cell = pair.new_cell()
    tool_id = pair.host.start_tool_call(session, invocation(cell))
    note_id = pair.host.start_notification(session, "call-1", CellId(cell), "hello")
    pair.run()
    assert pair.to_client[-1][0] == wire.OperationResponse(
        1, wire.WireOk(wire.SessionReady(session))
    )  # nothing before execution/started
    assert pair.host.pending_callbacks == 2
    assert pair.admit(start_event, cell) == cell
    pair.run()
    assert pair.client_events[-3:] == [
        ev.CellStarted(request_id, session, CellId(cell)),
        ev.CallbackRequested(tool_id, session, ev.ToolCallback(invocation(cell))),
        ev.CallbackRequested(
            note_id, session, ev.NotificationCallback("call-1", CellId(cell), "hello")
        ),
    ]
    assert pair.resolved == {
        tool_id: ToolReturned({"echo": {"v": 1}}),
        note_id: NotificationAccepted(),
    }
    # A callback while the cell runs, then the initial response and the end of the cell.
    pair.tool_result = lambda callback: ToolReturned(None)
    tool_id = pair.host.start_tool_call(session, invocation(cell, [1, 2]))
    pair.run()
    assert pair.resolved[tool_id] == ToolReturned(None)
    pair.respond(start_event, cell)
    pair.run()
    assert last(pair) == ev.InitialResponse(request_id, Yielded(CellId(cell), [InputText("y")]))
    pair.close_cell(session, cell)
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    assert pair.host.pending_callbacks == 0
    assert pair.client.unresolved_callbacks() == 0


@scenario
def callback_failures(recorder: Recorder) -> None:
    """D4 (the delegate raised), D5 (not JSON), and L7 for an undelivered notification."""
    pair = Pair(recorder)
    session = open_session(pair)
    _, cell = start(pair, session)
    pair.tool_result = lambda callback: callback_failure(RuntimeError("kaput"))
    first = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    assert pair.resolved[first] == CallbackFailed(delegate_task_failed("kaput"))
    pair.tool_result = lambda callback: callback_failure(CodeModeError("no such tool"))
    second = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    assert pair.resolved[second] == CallbackFailed("no such tool")
    pair.tool_result = lambda callback: ToolReturned({"x": float("nan")})
    third = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    assert pair.resolved[third] == CallbackFailed(
        delegate_result_not_json("nan is not a JSON number")
    )
    pair.tool_result = lambda callback: ToolReturned({1j})
    fourth = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    result = pair.resolved[fourth]
    assert isinstance(result, CallbackFailed)
    assert result.message.startswith(delegate_result_not_json(""))
    pair.notification_result = lambda callback: callback_failure(ValueError())
    note = pair.host.start_notification(session, "call-1", CellId(cell), "hi")
    pair.run()
    result = pair.resolved[note]
    assert result == CallbackFailed(delegate_task_failed("ValueError"))
    # What the runtime logs for it (L7).
    assert notification_not_delivered(result.message) == (
        "failed to deliver code mode notification: code-mode delegate task failed: ValueError"
    )
    assert pair.client.is_alive()
    assert not pair.host.ended


@scenario
def callback_revoked(recorder: Recorder) -> None:
    """The runtime revokes a running callback: delegate/cancel, the answer is suppressed; an answer
    already on its way when the host revoked is ignored."""
    pair = Pair(recorder, manual_client={ev.CallbackRequested, ev.CallbackCancelled})
    session = open_session(pair)
    _, cell = start(pair, session)
    first = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    requested = take(pair.client_inbox, ev.CallbackRequested)
    pair.host.revoke_callback(first)
    pair.host.revoke_callback(first)  # idempotent
    pair.run()
    assert take(pair.client_inbox, ev.CallbackCancelled) == ev.CallbackCancelled(first)
    assert pair.client.unresolved_callbacks() == 0
    pair.finish(requested)
    pair.run()
    assert not sent_to_host(pair, wire.DelegateResponseMessage)  # suppressed
    assert first not in pair.resolved
    # The answer crosses the revocation.
    second = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    requested = take(pair.client_inbox, ev.CallbackRequested)
    pair.host.revoke_callback(second)
    pair.finish(requested)
    pair.run()
    assert [m.id for m in sent_to_host(pair, wire.DelegateResponseMessage)] == [second]
    assert not pair.client_inbox  # the delegate/cancel came too late to matter
    assert second not in pair.resolved
    assert pair.host.pending_callbacks == 0
    # The runtime's grace runs out: both end as revoked, once.
    pair.host.revocation_expired(first)
    pair.host.revocation_expired(second)
    pair.host.revocation_expired(second)
    pair.run()
    assert pair.resolved[first] == CallbackFailed(texts.CALLBACK_REVOKED)
    assert pair.resolved[second] == CallbackFailed(texts.CALLBACK_REVOKED)
    assert pair.client.is_alive()
    assert not pair.host.ended
    error = pair.raises(
        LocalProtocolError, pair.client.finish_callback, second, NotificationAccepted()
    )
    assert error.message == f"callback {second} is not running"


@scenario
def cell_closed_with_running_callback(recorder: Recorder) -> None:
    """cell/closed revokes the cell's callbacks; cell_closed fires once their tasks ended."""
    pair = Pair(recorder, manual_client={ev.CallbackRequested, ev.CallbackCancelled})
    session = open_session(pair)
    _, cell = start(pair, session)
    delegate_id = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    requested = take(pair.client_inbox, ev.CallbackRequested)
    pair.close_cell(session, cell)
    pair.run()
    assert [type(m).__name__ for m, _ in pair.to_client[-2:]] == ["DelegateCancel", "CellClosed"]
    assert take(pair.client_inbox, ev.CallbackCancelled) == ev.CallbackCancelled(delegate_id)
    assert not pair.client_of(ev.CellClosed)  # its task still runs
    assert pair.client.open_cells(session) == 1
    pair.finish(requested, CallbackFailed("whatever"))
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    assert pair.client.open_cells(session) == 0
    assert not sent_to_host(pair, wire.DelegateResponseMessage)


@scenario
def connection_closed_callbacks(recorder: Recorder) -> None:
    """J4: callbacks pending when the host ends, and those started after."""
    pair = Pair(recorder, manual_client={ev.CallbackRequested})
    session = open_session(pair)
    _, cell = start(pair, session)
    pending = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    pair.host.close()
    pair.run()
    host_ended(pair, None, ())
    late = pair.host.start_notification(session, "call-1", CellId(cell), "late")
    pair.run()
    assert pair.resolved == {
        pending: CallbackFailed(texts.CLIENT_CONNECTION_CLOSED),
        late: CallbackFailed(texts.CLIENT_CONNECTION_CLOSED),
    }
    assert pair.host.pending_callbacks == 0


@scenario
def too_many_callbacks(recorder: Recorder) -> None:
    """J1 on the host at its 1,025th unresolved callback; D1 on the client at its 1,025th."""
    pair = Pair(recorder, manual_client={ev.CallbackRequested})
    session = open_session(pair)
    _, cell = start(pair, session)
    for _ in range(MAX_PENDING_DELEGATE_CALLS):
        pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    assert pair.host.pending_callbacks == MAX_PENDING_DELEGATE_CALLS
    assert pair.client.unresolved_callbacks() == MAX_PENDING_DELEGATE_CALLS
    over = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    assert pair.resolved == {over: CallbackFailed(texts.TOO_MANY_CALLBACKS)}
    # A host that ignored the cap: the client refuses on its own (the refusal is kept from the
    # host, which never sent this callback).
    pair.rewrite_to_host = lambda message: (
        None
        if isinstance(message, wire.DelegateResponseMessage) and message.id == 5000
        else message
    )
    crafted = wire.DelegateRequestMessage(
        5000, session, wire.NotificationSend("call-1", cell, "one too many")
    )
    refusals = recorder.texts.count(texts.TOO_MANY_CALLBACKS)
    pair.inject("client", crafted)
    assert recorder.texts.count(texts.TOO_MANY_CALLBACKS) == refusals + 1
    assert isinstance(pair.client_events[-1], ev.CallbackRequested)  # nothing new
    assert len(pair.client_inbox) == MAX_PENDING_DELEGATE_CALLS
    assert pair.client.unresolved_callbacks() == MAX_PENDING_DELEGATE_CALLS
    assert pair.client.is_alive()
    # One callback ends: there is room again.
    first = take(pair.client_inbox, ev.CallbackRequested)
    pair.finish(first)
    pair.run()
    assert pair.client.unresolved_callbacks() == MAX_PENDING_DELEGATE_CALLS - 1
    assert pair.resolved[first.delegate_id] == ToolReturned({"echo": {"v": 1}})
    assert pair.host.pending_callbacks == MAX_PENDING_DELEGATE_CALLS - 1


@scenario
def invalid_callback_answers(recorder: Recorder) -> None:
    """J2 and J3: the client answers a callback with the other kind's result."""
    pair = Pair(recorder)
    session = open_session(pair)
    _, cell = start(pair, session)

    def swap(message: wire.ClientToHost) -> wire.ClientToHost:
        if isinstance(message, wire.DelegateResponseMessage) and isinstance(
            message.result, wire.WireOk
        ):
            value: wire.DelegateResponse = (
                wire.NotificationDelivered()
                if isinstance(message.result.value, wire.ToolResult)
                else wire.ToolResult(msgspec.Raw(b"1"))
            )
            return wire.DelegateResponseMessage(message.id, wire.WireOk(value))
        return message

    pair.rewrite_to_host = swap
    tool = pair.host.start_tool_call(session, invocation(cell))
    note = pair.host.start_notification(session, "call-1", CellId(cell), "hi")
    pair.run()
    assert pair.resolved == {
        tool: CallbackFailed(texts.INVALID_TOOL_RESULT),
        note: CallbackFailed(texts.INVALID_NOTIFICATION_RESULT),
    }


@scenario
def oversize_frames(recorder: Recorder) -> None:
    """H8 (an answer), J5 (a tool call) and D6 (a tool result) that do not fit in a frame."""
    big = "x" * MAX_FRAME_BYTES
    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request("yield"))
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    cell = pair.admit(start_event)
    assert cell is not None
    # J5
    call = pair.host.start_tool_call(session, invocation(cell, big))
    pair.run()
    result = pair.resolved[call]
    assert isinstance(result, CallbackFailed)
    assert re.fullmatch(
        re.escape(texts.callback_too_large(""))
        + r"code-mode IPC frame length \d+ exceeds 67108864 bytes",
        result.message,
    )
    assert pair.host.pending_callbacks == 0
    # D6
    pair.tool_result = lambda callback: ToolReturned(big)
    call = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    result = pair.resolved[call]
    assert isinstance(result, CallbackFailed)
    assert result.message.startswith(texts.answer_too_large("code-mode IPC frame length "))
    assert pair.client.is_alive()
    # H8
    pair.host.initial_response(start_event.request_id, Result(CellId(cell), [InputText(big)]))
    pair.run()
    message = failed(pair, request_id).message
    assert message.startswith(texts.response_too_large("code-mode IPC frame length "))
    assert not failed(pair, request_id).connection_lost
    pair.close_cell(session, cell)
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    assert pair.client.is_alive()


# -- lanes of a dual connection -------------------------------------------------------------------------


@scenario
def callback_overtakes_execution_started(recorder: Recorder) -> None:
    """On bulk, tool/invoke overtakes execution/started on control: the client parks it."""
    pair = Pair(recorder, dual=True, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request("yield"))
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    pair.hold(Lane.CONTROL, to="client")
    cell = pair.admit(start_event)
    assert cell is not None
    parked = pair.host.start_tool_call(session, invocation(cell))
    revoked = pair.host.start_tool_call(session, invocation(cell, 2))
    pair.run()
    assert pair.client.unresolved_callbacks() == 2
    assert not pair.client_of(ev.CallbackRequested)
    pair.host.revoke_callback(revoked)  # a parked callback is dropped without an answer
    pair.run()
    assert pair.client.unresolved_callbacks() == 1
    pair.release(Lane.CONTROL, to="client")
    assert pair.client_events[-2:] == [
        ev.CellStarted(request_id, session, CellId(cell)),
        ev.CallbackRequested(parked, session, ev.ToolCallback(invocation(cell))),
    ]
    assert pair.resolved == {parked: ToolReturned({"echo": {"v": 1}})}
    assert [m.id for m in sent_to_host(pair, wire.DelegateResponseMessage)] == [parked]
    assert pair.client.unresolved_callbacks() == 0


@scenario
def parked_callback_refused(recorder: Recorder) -> None:
    """A tool call for a cell already closed arrives while another execute awaits admission: the
    client parks it, then refuses it (D3) when that execute fails without naming the cell."""
    pair = Pair(recorder, dual=True)
    session = open_session(pair)
    _, cell = start(pair, session)
    pair.manual_host.add(ev.StartExecute)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    pair.hold(Lane.BULK, to="client")
    delegate_id = pair.host.start_tool_call(session, invocation(cell))
    pair.close_cell(session, cell)  # delegate/cancel (held on bulk), cell/closed (control)
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    pair.release(Lane.BULK, to="client", count=1)  # the tool/invoke only
    assert pair.client.unresolved_callbacks() == 1  # parked
    assert not pair.client_of(ev.CallbackRequested)
    pair.host.operation_failed(start_event.request_id, "no room")
    pair.run()
    assert failed(pair, request_id) == ev.OperationFailed(request_id, "no room")
    refused = wire.WireError(texts.callback_for_unknown_cell(cell, session))
    assert [
        (m, lane) for m, lane in pair.to_host if isinstance(m, wire.DelegateResponseMessage)
    ] == [(wire.DelegateResponseMessage(delegate_id, refused), Lane.BULK)]
    assert pair.client.unresolved_callbacks() == 0
    pair.release(Lane.BULK, to="client")  # the delegate/cancel: nothing left to cancel
    assert not pair.client_of(ev.CallbackCancelled)
    assert delegate_id not in pair.resolved  # revoked on the host: the refusal is ignored
    assert pair.client.is_alive()
    assert not pair.host.ended


def _wire_invocation(cell: str) -> wire.WireNestedToolCall:
    return wire.WireNestedToolCall(
        cell, "tool-call-9", wire.WireToolName("echo", None), "function", 1
    )


@scenario
def cell_closed_before_late_tool_call(recorder: Recorder) -> None:
    """On a dual connection cell/closed (control) overtakes a tool/invoke (bulk): the client
    refuses it (D3) and the host, which had revoked it, ignores the refusal."""
    pair = Pair(recorder, dual=True)
    session = open_session(pair)
    _, cell = start(pair, session)
    pair.hold(Lane.BULK, to="client")
    delegate_id = pair.host.start_tool_call(session, invocation(cell))
    pair.close_cell(session, cell)
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    pair.release(Lane.BULK, to="client")
    refusal = sent_to_host(pair, wire.DelegateResponseMessage)
    assert refusal == [
        wire.DelegateResponseMessage(
            delegate_id, wire.WireError(texts.callback_for_unknown_cell(cell, session))
        )
    ]
    assert delegate_id not in pair.resolved  # revoked: its end is the runtime's grace
    assert pair.host.pending_callbacks == 0
    assert pair.client.unresolved_callbacks() == 0
    assert pair.client.is_alive()
    assert not pair.host.ended


@scenario
def session_closed_before_late_tool_call(recorder: Recorder) -> None:
    """The same race across a shutdown: session/closed overtakes the tool/invoke (D2). A host
    that calls back for a session it already closed gets the same refusal."""
    pair = Pair(recorder, dual=True)
    session = open_session(pair)
    _, cell = start(pair, session)
    pair.hold(Lane.BULK, to="client")
    delegate_id = pair.host.start_tool_call(session, invocation(cell))
    shutdown_id = pair.client.shutdown(session)
    pair.run()
    assert pair.client_events[-2:] == [
        ev.SessionShutDown(shutdown_id, session),
        ev.SessionForgotten(session),
    ]
    pair.release(Lane.BULK, to="client")
    refused = wire.WireError(texts.callback_for_unknown_session(session))
    assert sent_to_host(pair, wire.DelegateResponseMessage) == [
        wire.DelegateResponseMessage(delegate_id, refused)
    ]
    assert delegate_id not in pair.resolved
    late = pair.host.start_notification(session, "call-1", CellId(cell), "late")
    pair.run()
    assert pair.resolved == {late: CallbackFailed(texts.callback_for_unknown_session(session))}
    assert pair.client.is_alive()
    assert not pair.host.ended


# -- cancellation ------------------------------------------------------------------------------------


@scenario
def cancel_before_admission(recorder: Recorder) -> None:
    """operation/cancel reaches the host before admission: H1, which the client discards; a late
    admission by the runtime is refused."""
    pair = Pair(recorder, manual_host={ev.StartExecute, ev.CancelOperation})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    pair.client.cancel(request_id)
    pair.client.cancel(request_id)  # once on the wire
    pair.run()
    assert sent_to_host(pair, wire.OperationCancel) == [wire.OperationCancel(request_id)]
    assert take(pair.host_inbox, ev.CancelOperation) == ev.CancelOperation(request_id)
    assert pair.host.cancelled(request_id)
    # The runtime's cell had called a tool before the glue reported it; the admission is refused
    # and the tool call, held for execution/started, is dropped unsent.
    cell = pair.new_cell()
    early = pair.host.start_tool_call(session, invocation(cell))
    assert pair.admit(start_event, cell) is None
    pair.run()
    assert pair.host.pending_callbacks == 0
    assert not any(isinstance(m, wire.DelegateRequestMessage) for m, _ in pair.to_client)
    assert early not in pair.resolved  # its end is the runtime's (its cell is gone)
    assert pair.to_client[-1][0] == wire.OperationResponse(
        request_id, wire.WireError(texts.REQUEST_CANCELLED)
    )
    assert not pair.host.in_flight(request_id)
    assert pair.host.active_cells == 0
    assert pair.client.pending_requests() == 0
    assert not pair.client_of(ev.OperationFailed)
    # The ordinary path: the runtime stops the operation.
    pair.manual_host.discard(ev.CancelOperation)
    request_id = pair.client.execute(session, request())
    pair.run()
    take(pair.host_inbox, ev.StartExecute)
    pair.client.cancel(request_id)
    pair.run()
    assert pair.to_client[-1][0] == wire.OperationResponse(
        request_id, wire.WireError(texts.REQUEST_CANCELLED)
    )
    assert pair.client.pending_requests() == 0
    pair.client.cancel(request_id)  # finished: ignored
    pair.client.cancel(12345)  # unknown: ignored
    pair.run()
    assert len(sent_to_host(pair, wire.OperationCancel)) == 2


@scenario
def cancel_crosses_admission(recorder: Recorder) -> None:
    """The client cancels while execution/started is on its way: the host ignores the cancel
    (admitted), the client terminates the cell it never reported, then releases it."""
    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    pair.hold(Lane.CONTROL, to="client")
    cell = pair.admit(start_event)
    assert cell is not None
    pair.run()
    pair.client.cancel(request_id)
    pair.run()
    assert not pair.host_of(ev.CancelOperation)  # an admitted execute is not cancellable
    pair.release(Lane.CONTROL, to="client")
    assert requests_to_host(pair, wire.SessionTerminate) == [wire.SessionTerminate(session, cell)]
    assert not pair.client_of(ev.CellStarted)
    # The terminate was answered, and the cell's cell/closed waits for the initial response.
    assert pair.client.open_cells(session) == 1
    pair.respond(start_event, cell)
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    assert not pair.client_of(ev.InitialResponse)
    assert not pair.client_of(ev.WaitAnswered)
    assert pair.client.pending_requests() == 0
    assert pair.client.open_cells(session) == 0


@scenario
def cancel_after_admission(recorder: Recorder) -> None:
    """Cancel and abandon after CellStarted, before the initial response."""
    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    cell = pair.admit(start_event)
    assert cell is not None
    pair.run()
    assert last(pair) == ev.CellStarted(request_id, session, CellId(cell))
    pair.client.abandon_cell(session, CellId(cell), request_id)
    pair.client.abandon_cell(session, CellId(cell), request_id)  # idempotent
    pair.client.cancel(request_id)  # already cancelled
    pair.run()
    assert sent_to_host(pair, wire.OperationCancel) == [wire.OperationCancel(request_id)]
    assert requests_to_host(pair, wire.SessionTerminate) == [wire.SessionTerminate(session, cell)]
    pair.respond(start_event, cell)
    pair.run()
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    assert pair.client.pending_requests() == 0
    assert not pair.client_of(ev.InitialResponse)


@scenario
def cancelled_wait_defers_the_next(recorder: Recorder) -> None:
    """A wait after a cancelled wait of the same cell is held back until the cancelled one is
    answered (§9.4); a held-back wait that is cancelled never leaves."""
    pair = Pair(recorder, manual_host={ev.StartWait, ev.CancelOperation})
    session = open_session(pair)
    _, cell = start(pair, session)
    first = pair.client.wait(session, wait_for(cell))
    pair.run()
    first_event = take(pair.host_inbox, ev.StartWait)
    pair.client.cancel(first)
    second = pair.client.wait(session, wait_for(cell))
    dropped = pair.client.wait(session, wait_for(cell))
    pair.client.cancel(dropped)
    pair.run()
    assert [m.id for m in sent_to_host(pair, wire.OperationRequest)][-1] == first
    assert take(pair.host_inbox, ev.CancelOperation) == ev.CancelOperation(first)
    assert pair.client.pending_requests() == 2  # first (cancelled) and second (held back)
    # The cancelled wait is answered with H1; the held-back wait leaves.
    pair.host.operation_cancelled(first_event.request_id)
    pair.run()
    second_event = take(pair.host_inbox, ev.StartWait)
    assert second_event.request_id == second
    assert all(m.id != dropped for m in sent_to_host(pair, wire.OperationRequest))
    pair.observe(second, session, cell)
    pair.run()
    assert pair.client_events[-2:] == [
        ev.WaitAnswered(second, LiveCell(Result(CellId(cell), [InputText("w")]))),
        ev.CellClosed(session, CellId(cell)),
    ]
    assert not pair.client_of(ev.OperationFailed)
    assert pair.client.pending_requests() == 0


@scenario
def cancelled_wait_answered_first(recorder: Recorder) -> None:
    """The runtime answered before the cancel arrived: the answer is discarded, the cancel
    ignored, and the held-back wait leaves."""
    pair = Pair(recorder, manual_host={ev.StartWait})
    session = open_session(pair)
    _, cell = start(pair, session)
    first = pair.client.wait(session, wait_for(cell))
    pair.run()
    first_event = take(pair.host_inbox, ev.StartWait)
    pair.host.wait_completed(first_event.request_id, LiveCell(Yielded(CellId(cell))))
    pair.client.cancel(first)
    second = pair.client.wait(session, wait_for(cell))
    pair.run()
    assert not pair.host_of(ev.CancelOperation)
    assert not pair.client_of(ev.WaitAnswered)
    second_event = take(pair.host_inbox, ev.StartWait)
    assert second_event.request_id == second
    pair.host.wait_completed(second, LiveCell(Yielded(CellId(cell))))
    pair.run()
    assert last(pair) == ev.WaitAnswered(second, LiveCell(Yielded(CellId(cell))))


@scenario
def cancel_open_terminate_shutdown(recorder: Recorder) -> None:
    """Open, terminate and shutdown are not cancelled on the wire: their answers are discarded;
    a session whose open was abandoned is shut down at once."""
    pair = Pair(recorder, manual_host={ev.OpenSession})
    open_id = pair.client.open_session()
    session = pair.client.session_of(open_id)
    pair.run()
    opening = take(pair.host_inbox, ev.OpenSession)
    pair.client.cancel(open_id)
    pair.run()
    assert not sent_to_host(pair, wire.OperationCancel)
    pair.host.session_opened(opening.request_id)
    pair.run()
    assert requests_to_host(pair, wire.SessionShutdown) == [wire.SessionShutdown(session)]
    assert last(pair) == ev.SessionForgotten(session)
    assert not pair.client_of(ev.SessionOpened)
    assert not pair.client_of(ev.SessionShutDown)
    pair.manual_host.clear()
    session = open_session(pair)
    _, cell = start(pair, session)
    terminate_id = pair.client.terminate(session, CellId(cell))
    pair.client.cancel(terminate_id)
    pair.run()
    assert not pair.client_of(ev.WaitAnswered)
    assert last(pair) == ev.CellClosed(session, CellId(cell))
    shutdown_id = pair.client.shutdown(session)
    pair.client.cancel(shutdown_id)
    pair.run()
    assert last(pair) == ev.SessionForgotten(session)
    assert not pair.client_of(ev.SessionShutDown)
    assert not sent_to_host(pair, wire.OperationCancel)
    assert pair.client.pending_requests() == 0
    error = pair.raises(LocalProtocolError, pair.client.session_of, shutdown_id)
    assert error.message == f"request {shutdown_id} is not pending"


@scenario
def open_refused_by_runtime(recorder: Recorder) -> None:
    """The runtime cannot create the session: the error text is the runtime's, the session is
    forgotten on both ends; an operation crash answers with the internal-error text."""
    pair = Pair(recorder, manual_host={ev.OpenSession, ev.StartWait})
    open_id = pair.client.open_session()
    pair.run()
    pair.host.operation_failed(take(pair.host_inbox, ev.OpenSession).request_id, "no sandbox")
    pair.run()
    assert pair.client_events[-2:] == [
        ev.OperationFailed(open_id, "no sandbox"),
        ev.SessionForgotten("session-1"),
    ]
    open_id = pair.client.open_session()
    pair.run()
    pair.host.session_opened(take(pair.host_inbox, ev.OpenSession).request_id)
    pair.run()
    session = one(pair.client_of(ev.SessionOpened)).session_id
    _, cell = start(pair, session)
    wait_id = pair.client.wait(session, wait_for(cell))
    pair.run()
    pair.host.operation_crashed(take(pair.host_inbox, ev.StartWait).request_id, KeyError("k"))
    pair.run()
    assert failed(pair, wait_id) == ev.OperationFailed(
        wait_id, texts.host_internal_error(KeyError("k"))
    )
    assert failed(pair, wait_id).message == "code-mode host internal error: KeyError: 'k'"


@scenario
def shutdown_during_admission(recorder: Recorder) -> None:
    """C10: a shutdown fails the executes still awaiting admission (and cancels them); the host
    sends session/closed only once that execute was answered."""
    pair = Pair(recorder, manual_host={ev.StartExecute, ev.CancelOperation})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    take(pair.host_inbox, ev.StartExecute)
    shutdown_id = pair.client.shutdown(session)
    pair.client.cancel(request_id)  # already failed: nothing more
    pair.run()
    assert failed(pair, request_id) == ev.OperationFailed(
        request_id, texts.SESSION_CLOSED_DURING_EXECUTE
    )
    assert sent_to_host(pair, wire.OperationCancel) == [wire.OperationCancel(request_id)]
    assert not pair.client_of(ev.SessionShutDown)  # the execute is not answered yet
    pair.host.operation_cancelled(take(pair.host_inbox, ev.CancelOperation).request_id)
    pair.run()
    assert pair.client_events[-2:] == [
        ev.SessionShutDown(shutdown_id, session),
        ev.SessionForgotten(session),
    ]
    assert pair.client.pending_requests() == 0
    # A client that does not cancel: the runtime's late admission is refused (H5).
    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    pair.rewrite_to_host = lambda message: (
        None if isinstance(message, wire.OperationCancel) else message
    )
    shutdown_id = pair.client.shutdown(session)
    pair.run()
    assert not pair.client_of(ev.SessionShutDown)
    assert pair.admit(start_event) is None
    pair.run()
    assert [message for message, _ in pair.to_client[-2:]] == [
        wire.OperationResponse(request_id, wire.WireError(texts.unknown_session(session))),
        wire.OperationResponse(shutdown_id, wire.WireOk(wire.SessionClosed(session))),
    ]
    assert pair.client_events[-2:] == [
        ev.SessionShutDown(shutdown_id, session),
        ev.SessionForgotten(session),
    ]


# -- host limits and refusals (H) ---------------------------------------------------------------------


@scenario
def host_admission_limits(recorder: Recorder) -> None:
    """H3 (active cells), H2 (in-flight requests), H4 (stopping: running work goes on)."""
    host = HostProtocol(max_in_flight_requests=2, max_active_cells=1)
    pair = Pair(recorder, host=host, manual_host={ev.StartWait})
    session = open_session(pair)
    _, cell = start(pair, session)
    request_id = pair.client.execute(session, request())
    pair.run()
    assert failed(pair, request_id) == ev.OperationFailed(request_id, texts.TOO_MANY_CELLS)
    waits = [pair.client.wait(session, wait_for(cell)) for _ in range(3)]
    pair.run()
    assert failed(pair, waits[2]) == ev.OperationFailed(waits[2], texts.TOO_MANY_REQUESTS)
    assert pair.host_inbox == [
        ev.StartWait(wait_id, session, wait_for(cell)) for wait_id in waits[:2]
    ]
    pair.host.wait_completed(waits[0], LiveCell(Yielded(CellId(cell))))
    pair.host.stop_admitting()
    request_id = pair.client.execute(session, request())
    wait_id = pair.client.wait(session, wait_for(cell))
    pair.run()
    assert failed(pair, request_id) == ev.OperationFailed(request_id, texts.HOST_SHUTTING_DOWN)
    assert failed(pair, wait_id) == ev.OperationFailed(wait_id, texts.HOST_SHUTTING_DOWN)
    pair.host.wait_completed(waits[1], LiveCell(Yielded(CellId(cell))))
    pair.run()
    answered = [event.request_id for event in pair.client_of(ev.WaitAnswered)]
    assert answered == waits[:2]
    assert pair.client.open_cells(session) == 1
    assert pair.client.is_alive()


def _rewriting_requests(
    pair: Pair, change: Callable[[wire.HostRequest], wire.HostRequest | None]
) -> None:
    def rewrite(message: wire.ClientToHost) -> wire.ClientToHost:
        if isinstance(message, wire.OperationRequest):
            body = change(message.request)
            if body is not None:
                return wire.OperationRequest(message.id, body)
        return message

    pair.rewrite_to_host = rewrite


@scenario
def host_refusals(recorder: Recorder) -> None:
    """H5 (unknown session), H6 (invalid execute), H10 (open twice), H11 (id reused): requests
    altered in transit, since a correct client never sends them."""
    pair = Pair(recorder)
    session = open_session(pair)

    def change(body: wire.HostRequest) -> wire.HostRequest | None:
        if isinstance(body, wire.SessionWait):
            return wire.SessionWait("session-9", body.request)
        if isinstance(body, wire.SessionExecute):
            return wire.SessionExecute(
                body.session_id, msgspec.structs.replace(body.request, max_output_tokens=-1)
            )
        if isinstance(body, wire.SessionOpen):
            return wire.SessionOpen(session)
        return None

    _rewriting_requests(pair, change)
    wait_id = pair.client.wait(session, wait_for("cell-1"))
    pair.run()
    assert failed(pair, wait_id) == ev.OperationFailed(wait_id, texts.unknown_session("session-9"))
    execute_id = pair.client.execute(session, request())
    pair.run()
    detail = "out of range integral type conversion attempted"
    assert failed(pair, execute_id) == ev.OperationFailed(
        execute_id, texts.invalid_execute_request(detail)
    )
    open_id = pair.client.open_session()
    pair.run()
    assert pair.client_events[-2:] == [
        ev.OperationFailed(open_id, texts.session_already_open(session)),
        ev.SessionForgotten("session-2"),
    ]
    pair.rewrite_to_host = None
    pair.client.shutdown(session)
    pair.run()
    _rewriting_requests(pair, change)
    open_id = pair.client.open_session()
    pair.run()
    assert pair.client_events[-2:] == [
        ev.OperationFailed(open_id, texts.session_id_reused(session)),
        ev.SessionForgotten("session-3"),
    ]
    assert pair.client.is_alive()
    assert not pair.host.ended


@scenario
def session_unavailable(recorder: Recorder) -> None:
    """H5 from the runtime: the session a request waited for never opened."""
    pair = Pair(recorder, manual_host={ev.StartWait})
    session = open_session(pair)
    _, cell = start(pair, session)
    wait_id = pair.client.wait(session, wait_for(cell))
    pair.run()
    pair.host.session_unavailable(take(pair.host_inbox, ev.StartWait).request_id)
    pair.host.session_unavailable(wait_id)  # answered already: nothing
    pair.run()
    assert failed(pair, wait_id) == ev.OperationFailed(wait_id, texts.unknown_session(session))


# -- host connection errors (L) -----------------------------------------------------------------------


@scenario
def host_read_errors(recorder: Recorder) -> None:
    """L1 before the hello, L2 after it."""
    pair = Pair(recorder, connect=False)
    pair.hold(Lane.CONTROL, to="host")
    pair.inject_bytes("host", b"\x02\x00\x00\x00{]")
    assert pair.host.failure is not None
    assert pair.host.failure.startswith(
        texts.hello_read_failed("failed to decode code-mode IPC frame: JSON is malformed: ")
    )
    pair = Pair(recorder)
    session = open_session(pair)
    pair.manual_host.add(ev.StartWait)
    wait_id = pair.client.wait(session, wait_for("c"))
    pair.run()
    pair.inject_bytes("host", encode_frame({"type": "operation/nonsense"}))
    assert pair.host.failure is not None
    assert pair.host.failure.startswith(texts.client_read_failed("failed to decode"))
    assert pair.host_of(ev.ConnectionEnded)[0].requests == (wait_id,)
    # The glue closes the stream: the client learns K1.
    pair.eof("client")
    client_ended(pair, texts.HOST_CONNECTION_CLOSED)
    assert failed(pair, wait_id).connection_lost


@scenario
def host_protocol_violations(recorder: Recorder) -> None:
    """L3 (a second hello), L4 (a duplicate request id), L6 (an unknown callback answered)."""
    pair = Pair(recorder)
    pair.inject("host", wire.ConnectionHello((1,), (), ()))
    host_ended(pair, texts.SECOND_HELLO)

    pair = Pair(recorder)
    open_session(pair)
    replay = next(m for m, _ in pair.to_host if isinstance(m, wire.OperationRequest))
    pair.inject("host", replay)
    host_ended(pair, texts.duplicate_request_id(replay.id))

    pair = Pair(recorder)
    pair.inject("host", wire.DelegateResponseMessage(77, wire.WireOk(wire.NotificationDelivered())))
    host_ended(pair, texts.unknown_callback_answered(77))


@scenario
def host_wrong_lane(recorder: Recorder) -> None:
    """L5: an operation on the bulk socket; K6: a tool call on the control socket."""
    pair = Pair(recorder, dual=True)
    session = open_session(pair)
    pair.inject("host", wire.OperationRequest(50, wire.SessionShutdown(session)), Lane.BULK)
    host_ended(pair, texts.client_wrong_lane("operation/request", "bulk"))
    pair = Pair(recorder, dual=True)
    session = open_session(pair)
    _, cell = start(pair, session)
    crafted = wire.DelegateRequestMessage(1, session, wire.ToolInvoke(_wire_invocation(cell)))
    pair.inject("client", crafted, Lane.CONTROL)
    client_ended(pair, texts.host_wrong_lane("delegate/request", "control"))
    assert last(pair) == ev.CellClosed(session, CellId(cell))


@scenario
def host_glue_failures(recorder: Recorder) -> None:
    """L8 (a text message), a failed write, and a clean close."""
    ends: list[tuple[Callable[[HostProtocol], None], str | None]] = [
        (HostProtocol.text_received, texts.CLIENT_SENT_TEXT),
        (lambda host: host.write_failed("broken pipe"), texts.client_write_failed("broken pipe")),
        (lambda host: host.read_failed("reset"), texts.client_read_failed("reset")),
        (HostProtocol.close, None),
    ]
    for end, reason in ends:
        pair = Pair(recorder)
        end(pair.host)
        end(pair.host)  # the first end wins
        pair.run()
        host_ended(pair, reason)
        pair.inject("host", wire.OperationRequest(1, wire.SessionOpen("s")))  # ignored
        assert not pair.host_of(ev.OpenSession)
    pair = Pair(recorder, connect=False)
    pair.host.read_failed("reset")
    pair.run()
    host_ended(pair, texts.hello_read_failed("reset"))


# -- client connection errors (K) ---------------------------------------------------------------------


@scenario
def client_glue_failures(recorder: Recorder) -> None:
    """K1 (close), K2 (exit), K3 (read), K4 (write), K7 (text) once the handshake is done, and
    a request the host left unanswered past the glue's deadline."""
    ends: list[tuple[Callable[[ClientProtocol, int], None], str]] = [
        (lambda client, _: client.close(), texts.HOST_CONNECTION_CLOSED),
        (lambda client, _: client.host_exited(3), texts.host_exited(3)),
        (lambda client, _: client.read_failed("reset"), texts.host_read_failed("reset")),
        (lambda client, _: client.write_failed("EPIPE"), texts.host_write_failed("EPIPE")),
        (lambda client, _: client.text_received(), texts.HOST_SENT_TEXT),
        (
            lambda client, request_id: client.answer_overdue(request_id, "execution"),
            texts.host_timed_out("execution"),
        ),
    ]
    for end, reason in ends:
        pair = Pair(recorder, manual_host={ev.StartExecute})
        session = open_session(pair)
        request_id = pair.client.execute(session, request())
        pair.run()
        end(pair.client, request_id)
        pair.client.read_failed("later")  # the first failure wins
        pair.run()
        client_ended(pair, reason)
        assert failed(pair, request_id) == ev.OperationFailed(
            request_id, reason, connection_lost=True
        )
        assert pair.client.pending_requests() == 0


@scenario
def client_read_errors(recorder: Recorder) -> None:
    """K3 from a frame the client cannot read, on a stream and on a WebSocket."""
    pair = Pair(recorder)
    pair.inject_bytes("client", b"\x01\x00\x00\x00[")
    assert pair.client.failure is not None
    assert pair.client.failure.startswith(texts.host_read_failed("failed to decode"))
    pair = Pair(recorder, dual=True)
    pair.inject_bytes("client", b"\x05\x00\x00\x00{}")
    client_ended(
        pair,
        texts.host_read_failed("code-mode IPC frame declares 5 payload bytes but contains 2"),
    )


@scenario
def client_protocol_violations(recorder: Recorder) -> None:
    """K5, K8, K17 and K18: crafted host messages."""
    pair = Pair(recorder)
    pair.inject("client", wire.ConnectionReady(1, ()))
    client_ended(pair, texts.SECOND_HANDSHAKE_REPLY)

    pair = Pair(recorder)
    pair.inject("client", wire.OperationResponse(999, wire.WireError("x")))
    client_ended(pair, texts.unknown_request_id(999))

    pair = Pair(recorder)
    session = open_session(pair)
    pair.manual_host.add(ev.StartExecute)
    request_id = pair.client.execute(session, request())
    pair.run()
    pair.inject("client", wire.ExecuteInitialResponse(request_id, wire.WireError("early")))
    client_ended(pair, texts.unknown_request_id(request_id))

    pair = Pair(recorder, manual_client={ev.CallbackRequested})
    session = open_session(pair)
    _, cell = start(pair, session)
    delegate_id = pair.host.start_notification(session, "call-1", CellId(cell), "hi")
    pair.run()
    repeat = wire.DelegateRequestMessage(
        delegate_id, session, wire.NotificationSend("call-1", cell, "again")
    )
    pair.inject("client", repeat)
    client_ended(pair, texts.duplicate_callback_id(delegate_id))
    assert pair.client_events[-3:] == [
        ev.ConnectionEnded(texts.duplicate_callback_id(delegate_id)),
        ev.CallbackCancelled(delegate_id),
        ev.CellClosed(session, CellId(cell)),
    ]

    pair = Pair(recorder)  # a finished callback's id is remembered too
    session = open_session(pair)
    _, cell = start(pair, session)
    delegate_id = pair.host.start_notification(session, "call-1", CellId(cell), "hi")
    pair.run()
    pair.inject("client", repeat)
    client_ended(pair, texts.duplicate_callback_id(delegate_id))

    pair = Pair(recorder)
    session = open_session(pair)
    pair.inject("client", wire.CellClosed(session, "nope"))
    client_ended(pair, texts.unknown_cell_closed("nope", session))


def _rewriting_answers(
    pair: Pair, change: Callable[[wire.HostResponse], wire.HostResponse | None]
) -> None:
    def rewrite(message: wire.HostToClient) -> wire.HostToClient:
        if isinstance(message, wire.OperationResponse) and isinstance(message.result, wire.WireOk):
            value = change(message.result.value)
            if value is not None:
                return wire.OperationResponse(message.id, wire.WireOk(value))
        return message

    pair.rewrite_to_client = rewrite


@scenario
def invalid_host_answers(recorder: Recorder) -> None:
    """K9-K12 and K14: answers of the wrong kind, or naming the wrong session or cell."""
    pair = Pair(recorder)
    _rewriting_answers(
        pair,
        lambda value: wire.SessionReady("other") if isinstance(value, wire.SessionReady) else None,
    )
    request_id = pair.client.open_session()
    pair.run()
    client_ended(pair, texts.INVALID_OPEN_RESPONSE)
    assert failed(pair, request_id).connection_lost
    assert last(pair) == ev.OperationFailed(
        request_id, texts.INVALID_OPEN_RESPONSE, connection_lost=True
    )

    pair = Pair(recorder)
    session = open_session(pair)
    _rewriting_answers(
        pair,
        lambda value: (
            wire.SessionReady(session) if isinstance(value, wire.ExecutionStarted) else None
        ),
    )
    pair.client.execute(session, request())
    pair.run()
    client_ended(pair, texts.INVALID_EXECUTE_RESPONSE)

    pair = Pair(recorder)
    session = open_session(pair)
    _, cell = start(pair, session)
    _rewriting_answers(
        pair,
        lambda value: wire.SessionReady(session) if isinstance(value, wire.WaitCompleted) else None,
    )
    pair.client.terminate(session, CellId(cell))
    pair.run()
    client_ended(pair, texts.INVALID_CELL_RESPONSE)
    assert last(pair) == ev.CellClosed(session, CellId(cell))

    pair = Pair(recorder)
    session = open_session(pair)
    _, cell = start(pair, session)
    other = wire.WireRuntimeResponse(result=wire.WireResultBody("other", [], None))
    _rewriting_answers(
        pair,
        lambda value: (
            wire.WaitCompleted(wire.WireWaitOutcome(live_cell=other))
            if isinstance(value, wire.WaitCompleted)
            else None
        ),
    )
    pair.client.wait(session, wait_for(cell))
    pair.run()
    client_ended(pair, texts.wrong_cell_answered("other", cell))

    pair = Pair(recorder)
    session = open_session(pair)
    _rewriting_answers(
        pair,
        lambda value: (
            wire.SessionClosed("other") if isinstance(value, wire.SessionClosed) else None
        ),
    )
    pair.client.shutdown(session)
    pair.run()
    client_ended(pair, texts.INVALID_SHUTDOWN_RESPONSE)


@scenario
def faulty_runtime(recorder: Recorder) -> None:
    """K13 (a failed shutdown), K15 (an initial response for another cell), K16 (a live cell id
    reused): a runtime that misbehaves through the host machine's own API."""
    pair = Pair(recorder, manual_host={ev.StartShutdown})
    session = open_session(pair)
    shutdown_id = pair.client.shutdown(session)
    pair.run()
    pair.host.operation_failed(take(pair.host_inbox, ev.StartShutdown).request_id, "stuck")
    pair.run()
    client_ended(pair, texts.shutdown_failed(session, "stuck"))
    assert failed(pair, shutdown_id).connection_lost

    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    cell = pair.admit(start_event)
    assert cell is not None
    pair.host.initial_response(request_id, Result(CellId("elsewhere")))
    pair.run()
    client_ended(pair, texts.wrong_initial_response("elsewhere", cell))

    pair = Pair(recorder, manual_host={ev.StartExecute})
    session = open_session(pair)
    pair.client.execute(session, request())
    pair.client.execute(session, request())
    pair.run()
    first = take(pair.host_inbox, ev.StartExecute)
    second = take(pair.host_inbox, ev.StartExecute)
    pair.admit(first, "same")
    pair.admit(second, "same")
    pair.run()
    client_ended(pair, texts.live_cell_reused(session))


@scenario
def request_ids_exhausted(recorder: Recorder) -> None:
    """K19: the last id is used, the next request ends the connection."""
    pair = Pair(recorder, client=ClientProtocol(first_request_id=I64_MAX))
    session = open_session(pair)
    assert one(pair.host_of(ev.OpenSession)).request_id == I64_MAX
    error = pair.raises(LocalProtocolError, pair.client.execute, session, request())
    assert error.message == texts.REQUEST_IDS_EXHAUSTED
    client_ended(pair, texts.REQUEST_IDS_EXHAUSTED)
    assert not requests_to_host(pair, wire.SessionExecute)


# -- every scenario, and the coverage of texts ----------------------------------------------------


@pytest.mark.parametrize("conversation", SCENARIOS, ids=[f.__name__ for f in SCENARIOS])
def test_conversation(conversation: Scenario) -> None:
    conversation(Recorder())


def test_tool_call_after_cell_closed_on_host() -> None:
    pair = Pair()
    session = open_session(pair)
    _, cell = start(pair, session, "done")  # completed and closed
    late = pair.host.start_tool_call(session, invocation(cell))
    pair.run()
    shutdown_id = pair.client.shutdown(session)
    pair.run()
    assert isinstance(pair.resolved.get(late), CallbackFailed)
    assert pair.client_events[-2:] == [
        ev.SessionShutDown(shutdown_id, session),
        ev.SessionForgotten(session),
    ]


def test_admission_after_failed_shutdown() -> None:
    pair = Pair(manual_host={ev.StartExecute, ev.StartShutdown})
    session = open_session(pair)
    request_id = pair.client.execute(session, request())
    pair.run()
    start_event = take(pair.host_inbox, ev.StartExecute)
    # This client's operation/cancel for the execute is lost; nothing requires a client to send it.
    pair.rewrite_to_host = lambda message: (
        None if isinstance(message, wire.OperationCancel) else message
    )
    pair.client.shutdown(session)
    pair.run()
    pair.host.operation_failed(take(pair.host_inbox, ev.StartShutdown).request_id, "stuck")
    pair.run()
    assert pair.client.failure == texts.shutdown_failed(session, "stuck")
    assert pair.host.execution_started(start_event.request_id, CellId("late")) is False
    assert not pair.host.in_flight(request_id)


#: Texts of :mod:`codemode.protocol.v1.texts` no machine produces, with the reason.
EXEMPT: Final[dict[str, str]] = {}

_SENTINEL: Final = "QQ{}QQ"


def _public_texts() -> dict[str, str | Callable[..., str]]:
    """Every text the module defines (or re-exports in ``__all__``), by name."""
    tree = ast.parse(inspect.getsource(texts))
    names: set[str] = set(texts.__all__)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    public = {name: getattr(texts, name) for name in names if not name.startswith("_")}
    assert all(isinstance(value, str) or callable(value) for value in public.values())
    return public


def _shape(function: Callable[..., str]) -> re.Pattern[str]:
    """The output of ``function`` with every argument as a wildcard."""
    counter = itertools.count()
    arguments: list[object] = []
    for name, hint in typing.get_type_hints(function).items():
        if name == "return":
            continue
        if hint is BaseException:
            error_type = type(_SENTINEL.format(next(counter)), (Exception,), {})
            arguments.append(error_type(_SENTINEL.format(next(counter))))
        else:
            arguments.append(_SENTINEL.format(next(counter)))
    pieces = re.split(r"QQ\d+QQ", function(*arguments))
    return re.compile("(.+)".join(re.escape(piece) for piece in pieces), re.DOTALL)


def _with_nested(produced: set[str], shapes: list[re.Pattern[str]]) -> set[str]:
    """``produced`` plus every text nested in one (``handshake_rejected(invalid_hello(...))``)."""
    seen: set[str] = set()
    queue = list(produced)
    while queue:
        text = queue.pop()
        if text in seen:
            continue
        seen.add(text)
        for shape in shapes:
            match = shape.fullmatch(text)
            if match is not None:
                queue.extend(match.groups())
    return seen


def test_every_v1_text_is_produced() -> None:
    """Each text of ``codemode.protocol.v1.texts`` came out of a machine in these conversations.

    The conversations run here, so the result does not depend on which other tests ran.
    """
    recorder = Recorder()
    for conversation in SCENARIOS:
        conversation(recorder)
    public = _public_texts()
    assert set(EXEMPT) <= set(public)
    shapes = {name: _shape(value) for name, value in public.items() if callable(value)}
    produced = _with_nested(recorder.seen(), list(shapes.values()))

    def was_produced(name: str) -> bool:
        value = public[name]
        if isinstance(value, str):
            return value in produced
        return any(shapes[name].fullmatch(text) for text in produced)

    missing = sorted(name for name in public if name not in EXEMPT and not was_produced(name))
    assert not missing, f"never produced by the machines: {missing}"
    reachable = sorted(name for name in EXEMPT if was_produced(name))
    assert not reachable, f"exempt but produced, drop the exemption: {reachable}"
