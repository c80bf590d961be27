"""The gRPC host (``grpc.md`` §4-§12, §14.3), driven with the raw generated stub over loopback."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio

from codemode.errors import CodeModeError
from codemode.grpc_stubs import v1_pb2_grpc
from codemode.host.grpc import (
    MAX_SUBSCRIBED_TOOL_NAMES,
    MAX_SUBSCRIPTIONS_PER_SESSION,
    GrpcAddress,
    GrpcHost,
    GrpcHostOptions,
    serve_grpc,
)
from codemode.protocol import strict_json
from codemode.protocol.grpc import texts
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import MAX_MESSAGE_BYTES, SERVICE_NAME
from codemode.protocol.texts import TOO_MANY_CALLBACKS
from codemode.protocol.types import CellId, ExecuteRequest, WaitOutcome, WaitRequest
from codemode.runtime import LocalSessionProvider
from codemode.session import (
    EARLY_YIELD_UNSUPPORTED,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    StartedCell,
)
from tests.loop_encodes import watch_encoders
from tests.proxy import FreezingProxy

ECHO = pb.ToolDefinition(
    name="echo", tool_name=pb.ToolName(name="echo"), kind=pb.TOOL_KIND_FUNCTION
)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

Stub = Any  # the async stub (typed as CodeModeHostAsyncStub in the .pyi)


async def _connect(host: GrpcHost) -> tuple[aio.Channel, Stub]:
    url = await host.start()
    channel = aio.insecure_channel(url.removeprefix("grpc://"), options=CHANNEL_OPTIONS)
    return channel, v1_pb2_grpc.CodeModeHostStub(channel)


@contextlib.asynccontextmanager
async def _served(host: GrpcHost) -> AsyncIterator[Stub]:
    """A stub on a channel to ``host``, started here; both closed at the end."""
    channel, stub = await _connect(host)
    try:
        yield stub
    finally:
        await channel.close()
        await host.aclose()


@pytest.fixture
async def stub(provider: LocalSessionProvider) -> AsyncIterator[Stub]:
    host = GrpcHost(provider, "grpc://127.0.0.1:0")
    async with _served(host) as stub:
        yield stub


class Lease:
    """An open session: its lease stream and id."""

    def __init__(self, call: Any, session_id: str) -> None:
        self.call = call
        self.session_id = session_id

    async def next(self, timeout: float = 10.0) -> pb.SessionEvent:
        event = await asyncio.wait_for(self.call.read(), timeout)
        assert event is not aio.EOF
        assert isinstance(event, pb.SessionEvent)
        return event

    async def until(self, kind: str, timeout: float = 10.0) -> pb.SessionEvent:
        while True:
            event = await self.next(timeout)
            if event.WhichOneof("event") == kind:
                return event


async def _open(stub: Stub, request: pb.OpenSessionRequest | None = None) -> Lease:
    call = stub.OpenSession(request or pb.OpenSessionRequest())
    first = await asyncio.wait_for(call.read(), 30)
    assert first.WhichOneof("event") == "opened"
    session_id = first.opened.session_id
    assert uuid.UUID(session_id).version == 4
    return Lease(call, session_id)


def _execute(
    stub: Stub,
    lease: Lease,
    source: str,
    *,
    execution_id: str | None = None,
    tools: tuple[pb.ToolDefinition, ...] = (),
    yield_time_ms: int | None = None,
) -> Any:
    request = pb.ExecuteRequest(
        session_id=lease.session_id,
        execution_id=execution_id or str(uuid.uuid4()),
        tool_call_id="call-1",
        source=source,
        enabled_tools=list(tools),
    )
    if yield_time_ms is not None:
        request.yield_time_ms = yield_time_ms
    return stub.Execute(request)


async def _started(call: Any) -> pb.ExecutionStarted:
    event = await asyncio.wait_for(call.read(), 30)
    assert event.WhichOneof("event") == "started"
    started: pb.ExecutionStarted = event.started
    return started


async def _outcome(call: Any, timeout: float = 30) -> pb.ExecutionOutcome:
    event = await asyncio.wait_for(call.read(), timeout)
    assert event.WhichOneof("event") == "outcome"
    outcome: pb.ExecutionOutcome = event.outcome
    assert await call.read() is aio.EOF
    return outcome


def _texts(outcome: pb.ExecutionOutcome) -> list[str]:
    return [item.text.text for item in outcome.content_items]


async def _succeed(stub: Stub, lease: Lease, invocation_id: str, output_json: bytes) -> None:
    await stub.CompleteToolCall(
        pb.CompleteToolCallRequest(
            session_id=lease.session_id,
            invocation_id=invocation_id,
            succeeded=pb.ToolCallSucceeded(output_json=output_json),
        )
    )


async def _status(awaitable: Any) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as raised:
        await awaitable
    return raised.value


def _wait(lease: Lease, cell_id: str, yield_time_ms: int = 10_000, wait_id: str = "") -> Any:
    return pb.WaitRequest(
        session_id=lease.session_id,
        cell_id=cell_id,
        wait_id=wait_id or str(uuid.uuid4()),
        yield_time_ms=yield_time_ms,
    )


# -- lease, execute, outcome ----------------------------------------------------------------------


async def test_execute_sends_started_then_one_outcome_and_the_cell_closes(stub: Stub) -> None:
    lease = await _open(stub)
    execution_id = str(uuid.uuid4())
    call = _execute(stub, lease, "text('hi')", execution_id=execution_id)
    started = await _started(call)
    assert started.execution_id == execution_id
    assert started.cell_id == "1"
    outcome = await _outcome(call)
    assert outcome.WhichOneof("outcome") == "completed"
    assert not outcome.completed.HasField("error_text")
    assert _texts(outcome) == ["hi"]
    assert outcome.cell_id == "1"
    assert outcome.code_mode_host_duration_ns > 0
    closed = (await lease.until("cell_closed")).cell_closed
    assert (closed.execution_id, closed.cell_id, closed.final_tool_call_sequence) == (
        execution_id,
        "1",
        0,
    )
    assert await call.code() == grpc.StatusCode.OK


async def test_nested_tool_calls_are_sequenced_and_completed(stub: Stub) -> None:
    lease = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    execution_id = str(uuid.uuid4())
    call = _execute(
        stub,
        lease,
        "const a = await tools.echo({value: 1}); const b = await tools.echo({value: 2});"
        "text(JSON.stringify([a, b]));",
        execution_id=execution_id,
        tools=(ECHO,),
    )
    started = await _started(call)
    sequences = []
    for expected in (1, 2):
        tool_call = await asyncio.wait_for(subscription.read(), 10)
        assert tool_call.session_id == lease.session_id
        assert tool_call.execution_id == execution_id
        assert tool_call.cell_id == started.cell_id
        assert tool_call.tool_name.name == "echo"
        assert tool_call.tool_kind == pb.TOOL_KIND_FUNCTION
        assert tool_call.runtime_tool_call_id == f"tool-{expected}"
        assert uuid.UUID(tool_call.invocation_id).version == 4
        value = json.loads(tool_call.input_json)
        assert value == {"value": expected}
        sequences.append(tool_call.sequence)
        await _succeed(
            stub, lease, tool_call.invocation_id, json.dumps({"echo": expected}).encode()
        )
        # Completing it again is a no-op answered OK (as upstream 0.171.0 answers it).
        await stub.CompleteToolCall(
            pb.CompleteToolCallRequest(
                session_id=lease.session_id,
                invocation_id=tool_call.invocation_id,
                failed=pb.ToolCallFailed(message="late"),
            )
        )
    assert sequences == [1, 2]
    outcome = await _outcome(call)
    assert outcome.WhichOneof("outcome") == "completed"
    assert json.loads(_texts(outcome)[0]) == [{"echo": 1}, {"echo": 2}]
    closed = (await lease.until("cell_closed")).cell_closed
    assert closed.final_tool_call_sequence == 2
    assert closed.execution_id == execution_id
    subscription.cancel()


async def test_invalid_completions_are_refused_and_the_call_still_waits(stub: Stub) -> None:
    """A failure rejects the cell's call; a completion with no outcome, or whose output is not
    JSON, is refused and changes nothing: the call still takes a valid completion (upstream
    0.171.0's host; grpc.md §6.3 rejected the call)."""
    lease = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    source = (
        "for (let i = 0; i < 2; i++) {"
        "  try { text(JSON.stringify(await tools.echo({}))); }"
        "  catch (e) { text(String(e.message ?? e)); }"
        "}"
    )
    call = _execute(stub, lease, source, tools=(ECHO,))
    await _started(call)
    sid = lease.session_id
    first = await asyncio.wait_for(subscription.read(), 10)
    await stub.CompleteToolCall(
        pb.CompleteToolCallRequest(
            session_id=sid,
            invocation_id=first.invocation_id,
            failed=pb.ToolCallFailed(message="nope"),
        )
    )
    second = await asyncio.wait_for(subscription.read(), 10)
    error = await _status(
        stub.CompleteToolCall(
            pb.CompleteToolCallRequest(session_id=sid, invocation_id=second.invocation_id)
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == texts.TOOL_COMPLETION_MISSING_OUTCOME
    error = await _status(
        stub.CompleteToolCall(
            pb.CompleteToolCallRequest(
                session_id=sid,
                invocation_id=second.invocation_id,
                succeeded=pb.ToolCallSucceeded(output_json=b"{not json"),
            )
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("invalid code-mode tool output JSON: ")
    await stub.CompleteToolCall(
        pb.CompleteToolCallRequest(
            session_id=sid,
            invocation_id=second.invocation_id,
            succeeded=pb.ToolCallSucceeded(output_json=b'{"ok": 1}'),
        )
    )
    outcome = await _outcome(call)
    assert _texts(outcome) == ["nope", '{"ok":1}']
    subscription.cancel()


async def test_invocation_without_subscription_waits_for_one(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "text(JSON.stringify(await tools.echo({})))", tools=(ECHO,))
    await _started(call)
    await asyncio.sleep(0.3)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(
            session_id=lease.session_id, tool_names=[pb.ToolName(name="echo")]
        )
    )
    tool_call = await asyncio.wait_for(subscription.read(), 10)
    await _succeed(stub, lease, tool_call.invocation_id, b"7")
    assert _texts(await _outcome(call)) == ["7"]
    subscription.cancel()


async def test_terminating_a_cell_cancels_its_tool_call(stub: Stub) -> None:
    lease = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    call = _execute(stub, lease, "await tools.echo({})", tools=(ECHO,), yield_time_ms=60_000)
    started = await _started(call)
    tool_call = await asyncio.wait_for(subscription.read(), 10)
    response = await stub.Terminate(
        pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
    )
    assert response.live_cell.WhichOneof("outcome") == "terminated"
    cancelled = (await lease.until("tool_call_cancelled")).tool_call_cancelled
    assert cancelled.invocation_id == tool_call.invocation_id
    assert (await _outcome(call)).WhichOneof("outcome") == "terminated"
    closed = (await lease.until("cell_closed")).cell_closed
    assert closed.final_tool_call_sequence == 1
    await stub.CompleteToolCall(  # a cancelled invocation: a no-op answered OK (upstream's way)
        pb.CompleteToolCallRequest(
            session_id=lease.session_id,
            invocation_id=tool_call.invocation_id,
            succeeded=pb.ToolCallSucceeded(output_json=b"1"),
        )
    )
    never = str(uuid.uuid4())
    error = await _status(
        stub.CompleteToolCall(
            pb.CompleteToolCallRequest(
                session_id=lease.session_id,
                invocation_id=never.upper(),
                succeeded=pb.ToolCallSucceeded(output_json=b"1"),
            )
        )
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == texts.unknown_invocation(never)  # the parsed spelling
    subscription.cancel()


# -- notifications ----------------------------------------------------------------------------------


async def test_notification_outcome_waits_for_the_acknowledgement(stub: Stub) -> None:
    lease = await _open(stub)
    execution_id = str(uuid.uuid4())
    call = _execute(stub, lease, "notify('notice'); text('done')", execution_id=execution_id)
    started = await _started(call)
    notification = (await lease.until("notification")).notification
    assert (notification.execution_id, notification.cell_id) == (execution_id, started.cell_id)
    assert (notification.call_id, notification.text) == ("call-1", "notice")
    pending = asyncio.ensure_future(call.read())
    await asyncio.sleep(0.3)
    assert not pending.done()
    ack = pb.AcknowledgeNotificationRequest(
        session_id=lease.session_id, notification_id=notification.notification_id
    )
    await stub.AcknowledgeNotification(ack)
    event = await asyncio.wait_for(pending, 10)
    assert _texts(event.outcome) == ["done"]
    # Upstream 0.171.0 answers OK to any acknowledgement of a well-formed id: twice, unknown.
    await stub.AcknowledgeNotification(ack)
    await stub.AcknowledgeNotification(
        pb.AcknowledgeNotificationRequest(
            session_id=lease.session_id, notification_id=str(uuid.uuid4())
        )
    )
    error = await _status(
        stub.AcknowledgeNotification(
            pb.AcknowledgeNotificationRequest(
                session_id=lease.session_id, notification_id="not-a-uuid"
            )
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "code-mode notification ID must be a UUID"


async def test_terminate_cancels_a_pending_notification(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(
        stub, lease, "notify('pending'); await new Promise(() => {})", yield_time_ms=60_000
    )
    started = await _started(call)
    notification = (await lease.until("notification")).notification
    response = await stub.Terminate(
        pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
    )
    assert response.live_cell.WhichOneof("outcome") == "terminated"
    cancelled = (await lease.until("notification_cancelled")).notification_cancelled
    assert cancelled.notification_id == notification.notification_id
    assert (await _outcome(call)).WhichOneof("outcome") == "terminated"
    await stub.AcknowledgeNotification(  # a late acknowledgement is harmless (upstream: OK)
        pb.AcknowledgeNotificationRequest(
            session_id=lease.session_id, notification_id=notification.notification_id
        )
    )


# -- waits and termination ---------------------------------------------------------------------------


async def test_wait_on_missing_cell_and_unknown_session(stub: Stub) -> None:
    lease = await _open(stub)
    response = await stub.Wait(_wait(lease, "42"))
    assert response.WhichOneof("state") == "missing_cell"
    assert response.missing_cell.completed.error_text == "exec cell 42 not found"
    unknown = str(uuid.uuid4())
    request = _wait(lease, "1")
    request.session_id = unknown
    error = await _status(stub.Wait(request))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == texts.unknown_session(unknown)
    request.session_id = "not-a-uuid"
    error = await _status(stub.Wait(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "code-mode session ID must be a UUID"
    request.session_id = lease.session_id
    request.wait_id = "x" * 257
    error = await _status(stub.Wait(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "code-mode wait ID exceeds 256 bytes"


@pytest.mark.parametrize(
    ("value", "reason"),
    [("", "must not be empty"), ("a" * 257, "exceeds 256 bytes"), ("a" * 256, "must be a UUID")],
)
async def test_malformed_identifiers_have_upstreams_texts(
    stub: Stub, value: str, reason: str
) -> None:
    # Upstream 0.171.0: "code-mode ⟨what⟩ ID ⟨reason⟩"; the cell id is checked before the wait id.
    lease = await _open(stub)
    sid = lease.session_id
    uuids = reason == "must be a UUID"  # only session, invocation and notification ids
    calls: list[tuple[str, Any]] = [
        ("session", stub.Terminate(pb.TerminateRequest(session_id=value, cell_id="1"))),
        (
            "tool invocation",
            stub.CompleteToolCall(pb.CompleteToolCallRequest(session_id=sid, invocation_id=value)),
        ),
        (
            "notification",
            stub.AcknowledgeNotification(
                pb.AcknowledgeNotificationRequest(session_id=sid, notification_id=value)
            ),
        ),
    ]
    if not uuids:
        calls += [
            ("cell", stub.Wait(pb.WaitRequest(session_id=sid, cell_id=value, wait_id=value))),
            ("wait", stub.CancelWait(pb.CancelWaitRequest(session_id=sid, wait_id=value))),
            (
                "execution",
                stub.YieldObservation(
                    pb.YieldObservationRequest(session_id=sid, execution_id=value)
                ),
            ),
        ]
    for what, call in calls:
        error = await _status(call)
        assert (error.code(), error.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"code-mode {what} ID {reason}",
        )
    if not uuids:
        for field in ("execution_id", "tool_call_id"):
            request = pb.ExecuteRequest(
                session_id=sid, execution_id=str(uuid.uuid4()), tool_call_id="c", source="1"
            )
            setattr(request, field, value)
            error = await _status(stub.Execute(request).read())
            what = {"execution_id": "execution", "tool_call_id": "tool call"}[field]
            assert error.details() == f"code-mode {what} ID {reason}"


async def test_a_session_id_is_found_in_any_uuid_spelling(stub: Stub) -> None:
    lease = await _open(stub)
    value = uuid.UUID(lease.session_id)
    for spelling in (lease.session_id.upper(), value.hex, f"{{{value}}}", f"urn:uuid:{value}"):
        response = await stub.Terminate(pb.TerminateRequest(session_id=spelling, cell_id="9"))
        assert response.missing_cell.completed.error_text == "exec cell 9 not found"
    unknown = str(uuid.uuid4()).upper()
    error = await _status(stub.Terminate(pb.TerminateRequest(session_id=unknown, cell_id="9")))
    assert (error.code(), error.details()) == (
        grpc.StatusCode.NOT_FOUND,
        texts.unknown_session(unknown),  # the spelling sent
    )


async def test_requests_missing_their_oneof_have_upstreams_texts(stub: Stub) -> None:
    lease = await _open(stub)
    error = await _status(
        stub.YieldObservation(pb.YieldObservationRequest(session_id=lease.session_id))
    )
    assert (error.code(), error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "missing code-mode observation ID",
    )
    tool = pb.ToolDefinition(name="t", tool_name=pb.ToolName(name="t"), kind=pb.TOOL_KIND_FUNCTION)
    tool.input_schema_json = b"{"
    error = await _status(_execute(stub, lease, "text(1)", tools=(tool,)).read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("invalid tool input schema: ")


async def test_wait_id_reuse_and_second_observer(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
    started = await _started(call)
    assert (await _outcome(call)).WhichOneof("outcome") == "yielded"
    first = _wait(lease, started.cell_id, 60_000)
    waiting = asyncio.ensure_future(stub.Wait(first))
    await asyncio.sleep(0.3)
    error = await _status(stub.Wait(_wait(lease, started.cell_id, 60_000)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == f"exec cell {started.cell_id} already has an active observer"
    error = await _status(stub.Wait(first))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error.details() == texts.wait_id_reused(first.wait_id)
    response = await stub.Terminate(
        pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
    )
    assert response.live_cell.WhichOneof("outcome") == "terminated"
    finished = await asyncio.wait_for(waiting, 10)
    assert finished.live_cell.WhichOneof("outcome") == "terminated"


async def test_cancel_wait_detaches_the_observer(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
    started = await _started(call)
    await _outcome(call)
    request = _wait(lease, started.cell_id, 60_000)
    waiting = asyncio.ensure_future(stub.Wait(request))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(
        stub.CancelWait(pb.CancelWaitRequest(session_id=lease.session_id, wait_id=request.wait_id)),
        5,
    )
    error = await _status(waiting)
    assert error.code() == grpc.StatusCode.CANCELLED
    assert error.details() == texts.WAIT_WAS_CANCELLED
    # The old observer retired: the next wait attaches.
    response = await stub.Wait(_wait(lease, started.cell_id, 50))
    assert response.live_cell.WhichOneof("outcome") == "yielded"
    # Cancelling a finished wait does nothing.
    await stub.CancelWait(
        pb.CancelWaitRequest(session_id=lease.session_id, wait_id=request.wait_id)
    )


async def test_cancel_wait_before_its_wait(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
    started = await _started(call)
    await _outcome(call)
    wait_id = str(uuid.uuid4())
    await stub.CancelWait(pb.CancelWaitRequest(session_id=lease.session_id, wait_id=wait_id))
    error = await _status(stub.Wait(_wait(lease, started.cell_id, 60_000, wait_id)))
    assert error.code() == grpc.StatusCode.CANCELLED
    assert error.details() == texts.WAIT_WAS_CANCELLED
    response = await stub.Terminate(
        pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
    )
    assert response.live_cell.WhichOneof("outcome") == "terminated"


async def test_yield_observation_ends_a_wait_early(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
    started = await _started(call)
    await _outcome(call)
    request = _wait(lease, started.cell_id, 60_000)
    waiting = asyncio.ensure_future(stub.Wait(request))
    await asyncio.sleep(0.3)
    await stub.YieldObservation(
        pb.YieldObservationRequest(session_id=lease.session_id, wait_id=request.wait_id)
    )
    response = await asyncio.wait_for(waiting, 2)
    assert response.live_cell.WhichOneof("outcome") == "yielded"
    # Remembered when it overtakes its Wait.
    early = str(uuid.uuid4())
    await stub.YieldObservation(
        pb.YieldObservationRequest(session_id=lease.session_id, wait_id=early)
    )
    response = await asyncio.wait_for(stub.Wait(_wait(lease, started.cell_id, 60_000, early)), 2)
    assert response.live_cell.WhichOneof("outcome") == "yielded"
    # The cell keeps running.
    response = await stub.Terminate(
        pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
    )
    assert response.live_cell.WhichOneof("outcome") == "terminated"
    error = await _status(
        stub.YieldObservation(pb.YieldObservationRequest(session_id=lease.session_id))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_yield_observation_returns_the_items_so_far(stub: Stub) -> None:
    lease = await _open(stub)
    source = "await new Promise((r) => setTimeout(r, 200)); text('b'); await new Promise(() => {})"
    call = _execute(stub, lease, source, yield_time_ms=10)
    started = await _started(call)
    await _outcome(call)
    request = _wait(lease, started.cell_id, 60_000)
    waiting = asyncio.ensure_future(stub.Wait(request))
    await asyncio.sleep(0.6)
    await stub.YieldObservation(
        pb.YieldObservationRequest(session_id=lease.session_id, wait_id=request.wait_id)
    )
    response = await asyncio.wait_for(waiting, 2)
    assert [item.text.text for item in response.live_cell.content_items] == ["b"]


async def test_yield_observation_ends_an_execute_early(stub: Stub) -> None:
    lease = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    execution_id = str(uuid.uuid4())
    source = "text('a'); await tools.echo({}); text('b')"
    call = _execute(
        stub, lease, source, execution_id=execution_id, tools=(ECHO,), yield_time_ms=60_000
    )
    started = await _started(call)
    tool_call = await asyncio.wait_for(subscription.read(), 10)  # 'a' is out; the call hangs
    await stub.YieldObservation(
        pb.YieldObservationRequest(session_id=lease.session_id, execution_id=execution_id)
    )
    outcome = await _outcome(call, timeout=5)
    assert outcome.WhichOneof("outcome") == "yielded"
    assert _texts(outcome) == ["a"]
    # Once the observation ended, another YieldObservation for it is a no-op.
    await stub.YieldObservation(
        pb.YieldObservationRequest(session_id=lease.session_id, execution_id=execution_id)
    )
    # The cell went on: a later Wait sees what follows.
    await _succeed(stub, lease, tool_call.invocation_id, b"{}")
    response = await stub.Wait(_wait(lease, started.cell_id, 30_000))
    assert response.live_cell.WhichOneof("outcome") == "completed"
    assert [item.text.text for item in response.live_cell.content_items] == ["b"]
    closed = (await lease.until("cell_closed")).cell_closed
    assert (closed.execution_id, closed.final_tool_call_sequence) == (execution_id, 1)


async def test_yield_observation_that_overtakes_its_execute_is_remembered(stub: Stub) -> None:
    lease = await _open(stub)
    execution_id = str(uuid.uuid4())
    await stub.YieldObservation(
        pb.YieldObservationRequest(session_id=lease.session_id, execution_id=execution_id)
    )
    call = _execute(
        stub, lease, "await new Promise(() => {})", execution_id=execution_id, yield_time_ms=60_000
    )
    started = await _started(call)
    assert (await _outcome(call, timeout=5)).WhichOneof("outcome") == "yielded"
    # Only that execution: the next one runs its own timer.
    other = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=60_000)
    await _started(other)
    reading = asyncio.ensure_future(other.read())
    done, _ = await asyncio.wait((reading,), timeout=0.5)
    assert not done
    other.cancel()
    await asyncio.wait((reading,))
    assert reading.cancelled() or reading.exception() is not None or reading.result() is aio.EOF
    response = await stub.Terminate(
        pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
    )
    assert response.live_cell.WhichOneof("outcome") == "terminated"


async def test_terminate_of_a_missing_cell(stub: Stub) -> None:
    lease = await _open(stub)
    response = await stub.Terminate(pb.TerminateRequest(session_id=lease.session_id, cell_id="9"))
    assert response.missing_cell.completed.error_text == "exec cell 9 not found"


class _Terminating(CodeModeSession):
    """A session whose cells are always being terminated (the runtime's race, made certain)."""

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        raise CodeModeError("not used")

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        raise CodeModeError(f"exec cell {request.cell_id} already has an active observer")

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        raise CodeModeError(f"exec cell {cell_id} is already terminating")

    async def shutdown(self) -> None:
        return


class _TerminatingProvider(CodeModeSessionProvider):
    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        return _Terminating()


async def test_runtime_preconditions_pass_through_verbatim() -> None:
    host = GrpcHost(_TerminatingProvider())
    async with _served(host) as stub:
        lease = await _open(stub)
        error = await _status(
            stub.Terminate(pb.TerminateRequest(session_id=lease.session_id, cell_id="3"))
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == "exec cell 3 is already terminating"
        error = await _status(stub.Wait(_wait(lease, "3")))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == "exec cell 3 already has an active observer"


class _NoEarlyYield(CodeModeSession):
    """A session whose started cells cannot yield early (as over Protocol V1)."""

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        return StartedCell(CellId("1"), never)

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        raise CodeModeError("not used")

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        raise CodeModeError("not used")

    async def shutdown(self) -> None:
        return


class _NoEarlyYieldProvider(CodeModeSessionProvider):
    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        return _NoEarlyYield()


async def test_yield_observation_where_the_session_cannot_yield_early_is_unimplemented() -> None:
    host = GrpcHost(_NoEarlyYieldProvider())
    async with _served(host) as stub:
        lease = await _open(stub)
        execution_id = str(uuid.uuid4())
        call = _execute(stub, lease, "unused", execution_id=execution_id)
        await _started(call)
        error = await _status(
            stub.YieldObservation(
                pb.YieldObservationRequest(session_id=lease.session_id, execution_id=execution_id)
            )
        )
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED
        assert error.details() == EARLY_YIELD_UNSUPPORTED
        call.cancel()


# -- the session's end --------------------------------------------------------------------------------


async def test_dropping_the_lease_forgets_the_session_and_terminates_cells(
    stub: Stub, provider: LocalSessionProvider
) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=60_000)
    await _started(call)
    lease.call.cancel()
    assert (await _outcome(call, timeout=5)).WhichOneof("outcome") == "terminated"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 1
    while True:
        subscription = stub.SubscribeToToolCalls(
            pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
        )
        error = await _status(subscription.read())
        if error.code() == grpc.StatusCode.NOT_FOUND or loop.time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == texts.unknown_session(lease.session_id)
    assert provider.live_cells == 0


async def test_close_session_cancels_a_wait_and_ends_the_lease(stub: Stub) -> None:
    lease = await _open(stub)
    call = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
    started = await _started(call)
    await _outcome(call)
    waiting = asyncio.ensure_future(stub.Wait(_wait(lease, started.cell_id, 60_000)))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(
        stub.CloseSession(pb.CloseSessionRequest(session_id=lease.session_id)), 5
    )
    error = await _status(asyncio.wait_for(waiting, 1))
    assert error.code() == grpc.StatusCode.CANCELLED
    assert error.details() == texts.WAIT_WAS_CANCELLED  # upstream 0.171.0's text
    while True:
        event = await asyncio.wait_for(lease.call.read(), 1)
        if event is aio.EOF:
            break
    assert await lease.call.code() == grpc.StatusCode.OK
    error = await _status(stub.CloseSession(pb.CloseSessionRequest(session_id=lease.session_id)))
    assert error.code() == grpc.StatusCode.NOT_FOUND


# -- admission ------------------------------------------------------------------------------------------


async def test_execution_id_reuse_and_invalid_requests(stub: Stub) -> None:
    lease = await _open(stub)
    execution_id = str(uuid.uuid4())
    call = _execute(stub, lease, "text(1)", execution_id=execution_id)
    await _started(call)
    await _outcome(call)
    error = await _status(_execute(stub, lease, "text(1)", execution_id=execution_id).read())
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error.details() == texts.execution_id_reused(execution_id)
    bad = pb.ToolDefinition(name="bad", tool_name=pb.ToolName(name="bad"))
    error = await _status(_execute(stub, lease, "text(1)", tools=(bad,)).read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "tool definition has an invalid kind"


@pytest.mark.parametrize("value", [2**31, 2**64 - 1])
async def test_max_output_tokens_past_an_i32_is_accepted(stub: Stub, value: int) -> None:
    # A uint64 here, an i32 in the domain: it saturates, as upstream 0.171.0 accepts any value.
    lease = await _open(stub)
    request = pb.ExecuteRequest(
        session_id=lease.session_id,
        execution_id=str(uuid.uuid4()),
        tool_call_id="call-1",
        source="text('x'.repeat(100))",
        max_output_tokens=value,
    )
    call = stub.Execute(request)
    await _started(call)
    assert _texts(await _outcome(call)) == ["x" * 100]


async def test_invalid_limits_are_refused(stub: Stub) -> None:
    request = pb.OpenSessionRequest(
        cell_execution_limits=pb.SessionCellExecutionLimits(max_heap_size_bytes=0)
    )
    error = await _status(stub.OpenSession(request).read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith(texts.invalid_session_limits(""))


class _NoLimits(CodeModeSessionProvider):
    def __init__(self, inner: LocalSessionProvider) -> None:
        self.inner = inner

    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        return await self.inner.create_session(delegate)


async def test_unenforceable_heap_limit_fails_the_opening(provider: LocalSessionProvider) -> None:
    host = GrpcHost(_NoLimits(provider))
    async with _served(host) as stub:
        request = pb.OpenSessionRequest(
            cell_execution_limits=pb.SessionCellExecutionLimits(max_heap_size_bytes=16 << 20)
        )
        error = await _status(stub.OpenSession(request).read())
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == texts.HOST_CANNOT_ENFORCE_HEAP_LIMITS


async def test_active_cell_slot_is_released_after_cell_closed(
    provider: LocalSessionProvider,
) -> None:
    host = GrpcHost(provider, options=GrpcHostOptions(max_active_cells=1))
    async with _served(host) as stub:
        lease = await _open(stub)
        first = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
        started = await _started(first)
        await _outcome(first)
        error = await _status(_execute(stub, lease, "text(1)").read())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == texts.HOST_TOO_MANY_ACTIVE_CELLS
        request = pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
        await stub.Terminate(request)
        closed = (await lease.until("cell_closed")).cell_closed
        assert closed.cell_id == started.cell_id
        second = _execute(stub, lease, "text('again')")
        await _started(second)
        assert _texts(await _outcome(second)) == ["again"]


async def test_in_flight_requests_are_bounded(provider: LocalSessionProvider) -> None:
    host = GrpcHost(provider, options=GrpcHostOptions(max_in_flight_requests=1))
    async with _served(host) as stub:
        lease = await _open(stub)  # the lease does not count
        first = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=60_000)
        await _started(first)  # the Execute stream holds the only slot
        error = await _status(stub.Wait(_wait(lease, "1", 0)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == texts.HOST_TOO_MANY_IN_FLIGHT_REQUESTS
        first.cancel()  # abandoned: the cell is terminated and the slot freed
        closed = (await lease.until("cell_closed")).cell_closed
        assert closed.cell_id == "1"
        response = await stub.Wait(_wait(lease, "1", 0))
        assert response.WhichOneof("state") == "missing_cell"


@pytest.mark.timeout(60)
async def test_answers_to_the_hosts_requests_are_not_in_flight_requests(
    provider: LocalSessionProvider,
) -> None:
    # Decision 0018: CompleteToolCall and AcknowledgeNotification answer the host's own requests
    # (V1 delegate responses, which never count, protocol-v1.md §8.7): a busy host takes them.
    host = GrpcHost(provider, options=GrpcHostOptions(max_in_flight_requests=2))
    async with _served(host) as stub:
        lease = await _open(stub)
        subscription = stub.SubscribeToToolCalls(
            pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
        )
        idle = _execute(stub, lease, "await new Promise(() => {})", yield_time_ms=10)
        idle_cell = (await _started(idle)).cell_id
        await _outcome(idle)
        waiting = stub.Wait(_wait(lease, idle_cell, 60_000))  # holds one slot
        call = _execute(
            stub,
            lease,
            "notify('n'); text(JSON.stringify(await tools.echo({})))",
            tools=(ECHO,),
            yield_time_ms=30_000,
        )
        await _started(call)  # the Execute stream holds the other slot
        refused = await _status(stub.Wait(_wait(lease, idle_cell, 0)))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        notification = (await lease.until("notification")).notification
        await stub.AcknowledgeNotification(
            pb.AcknowledgeNotificationRequest(
                session_id=lease.session_id, notification_id=notification.notification_id
            )
        )
        tool_call = await asyncio.wait_for(subscription.read(), 10)
        await _succeed(stub, lease, tool_call.invocation_id, b'{"ok":true}')
        outcome = await _outcome(call)
        assert outcome.WhichOneof("outcome") == "completed"
        assert _texts(outcome) == ['{"ok":true}']
        waiting.cancel()
        subscription.cancel()


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_messages_of_64_mib_are_accepted(stub: Stub) -> None:
    lease = await _open(stub)
    invocation_id = str(uuid.uuid4())
    payload = b'"' + b"x" * (MAX_MESSAGE_BYTES - 1024) + b'"'
    error = await _status(
        stub.CompleteToolCall(
            pb.CompleteToolCallRequest(
                session_id=lease.session_id,
                invocation_id=invocation_id,
                succeeded=pb.ToolCallSucceeded(output_json=payload),
            )
        )
    )
    # Received and decoded whole: the answer is about the invocation, not the size.
    assert error.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_64_mib_tool_result_blocks_neither_the_lease_nor_other_executions(
    stub: Stub,
) -> None:
    pattern = "0123456789abcdef"
    repeats = (MAX_MESSAGE_BYTES - 4096) // len(pattern)
    lease = await _open(stub)
    other = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    source = (
        f"const r = await tools.echo({{}}); const expected = {pattern!r}.repeat({repeats});"
        "text(`${r.length} ${r === expected}`);"
    )
    big_call = _execute(stub, lease, source, tools=(ECHO,), yield_time_ms=200_000)
    await _started(big_call)
    tool_call = await asyncio.wait_for(subscription.read(), 30)
    request = pb.CompleteToolCallRequest(
        session_id=lease.session_id,
        invocation_id=tool_call.invocation_id,
        succeeded=pb.ToolCallSucceeded(output_json=f'"{pattern * repeats}"'.encode()),
    )
    assert MAX_MESSAGE_BYTES - request.ByteSize() < 8192  # just under the message limit
    completing = asyncio.ensure_future(stub.CompleteToolCall(request))
    del request

    async def on_the_other_session() -> list[str]:
        call = _execute(stub, other, "text('other')")
        await _started(call)
        return _texts(await _outcome(call, timeout=120))

    async def on_the_same_session() -> list[str]:
        call = _execute(stub, lease, "notify('ping'); text('same')")
        await _started(call)
        notification = (await lease.until("notification", timeout=120)).notification
        assert notification.text == "ping"
        await stub.AcknowledgeNotification(
            pb.AcknowledgeNotificationRequest(
                session_id=lease.session_id, notification_id=notification.notification_id
            )
        )
        return _texts(await _outcome(call, timeout=120))

    other_texts, same_texts = await asyncio.wait_for(
        asyncio.gather(on_the_other_session(), on_the_same_session()), 180
    )
    assert (other_texts, same_texts) == (["other"], ["same"])
    await asyncio.wait_for(completing, 180)
    assert _texts(await _outcome(big_call, timeout=180)) == [f"{len(pattern) * repeats} true"]


async def test_pending_callback_limit_text_is_the_shared_one() -> None:
    assert TOO_MANY_CALLBACKS == "code-mode host exceeded the limit of 1024 pending delegate calls"


async def test_subscription_headers_arrive_before_any_tool_call(stub: Stub) -> None:
    """A client may wait for the response headers of ``SubscribeToToolCalls`` before it sends
    its first ``Execute`` (upstream Codex 0.171 does): they must not wait for a ``ToolCall``."""
    lease = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    try:
        await asyncio.wait_for(subscription.initial_metadata(), 5)
    finally:
        subscription.cancel()
        lease.call.cancel()


async def test_health_service(provider: LocalSessionProvider) -> None:
    health = pytest.importorskip("grpc_health.v1.health_pb2")
    health_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
    host = GrpcHost(provider)
    channel, _ = await _connect(host)
    try:
        checker = health_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = await checker.Check(health.HealthCheckRequest(service=service))
            assert response.status == health.HealthCheckResponse.SERVING
        await host.shutdown(0)
    finally:
        await channel.close()
        await host.aclose()


async def test_draining_reports_not_serving_and_waits_for_running_cells(
    provider: LocalSessionProvider,
) -> None:
    health = pytest.importorskip("grpc_health.v1.health_pb2")
    health_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
    host = GrpcHost(provider)
    channel, stub = await _connect(host)
    draining: asyncio.Future[None] | None = None
    try:
        lease = await _open(stub)
        subscription = stub.SubscribeToToolCalls(
            pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
        )
        call = _execute(stub, lease, "await tools.echo({}); text('drained')", tools=(ECHO,))
        await _started(call)
        tool_call = await asyncio.wait_for(subscription.read(), 10)
        draining = asyncio.ensure_future(host.shutdown(60))
        checker = health_grpc.HealthStub(channel)
        request = health.HealthCheckRequest(service=SERVICE_NAME)
        for _ in range(200):
            if (await checker.Check(request)).status == health.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        for service in ("", SERVICE_NAME):
            response = await checker.Check(health.HealthCheckRequest(service=service))
            assert response.status == health.HealthCheckResponse.NOT_SERVING
        # No new work is admitted; the running cell goes on.
        error = await _status(_execute(stub, lease, "text(1)").read())
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details() == texts.HOST_SHUTTING_DOWN
        error = await _status(stub.OpenSession(pb.OpenSessionRequest()).read())
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert not draining.done()
        await _succeed(stub, lease, tool_call.invocation_id, b"{}")
        assert _texts(await _outcome(call)) == ["drained"]
        await asyncio.wait_for(draining, 30)  # the last cell closed: well before the grace
    finally:
        if draining is not None and not draining.done():
            draining.cancel()
        await channel.close()
        await host.aclose()


async def test_sessions_log_their_open_and_close(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="codemode.host")
    lease = await _open(stub)
    call = _execute(stub, lease, "text('x')")
    started = await _started(call)
    await _outcome(call)
    await lease.until("cell_closed")
    await stub.CloseSession(pb.CloseSessionRequest(session_id=lease.session_id))
    lines = [r.getMessage() for r in caplog.records if r.name == "codemode.host"]
    session = lease.session_id
    assert any(line.startswith(f"event=session-open session={session} peer=") for line in lines)
    assert any(
        re.fullmatch(
            rf"event=session-close session={session} duration_ms=\d+ cells=1 reason=close-session",
            line,
        )
        for line in lines
    ), lines
    assert any(
        re.fullmatch(
            rf"event=cell-closed session={session} execution=\S+ cell={started.cell_id} "
            r"tool_calls=0",
            line,
        )
        for line in lines
    ), lines


async def test_a_dropped_lease_is_logged_as_such(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="codemode.host")
    lease = await _open(stub)
    lease.call.cancel()
    needle = f"event=session-close session={lease.session_id} "
    for _ in range(200):
        closes = [r.getMessage() for r in caplog.records if needle in r.getMessage()]
        if closes:
            break
        await asyncio.sleep(0.05)
    assert len(closes) == 1 and closes[0].endswith(" cells=0 reason=lease-ended"), closes


async def test_open_sessions_are_bounded(provider: LocalSessionProvider) -> None:
    host = GrpcHost(provider, options=GrpcHostOptions(max_sessions=1))
    async with _served(host) as stub:
        first = await _open(stub)
        error = await _status(stub.OpenSession(pb.OpenSessionRequest()).read())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == texts.HOST_TOO_MANY_OPEN_SESSIONS
        await stub.CloseSession(pb.CloseSessionRequest(session_id=first.session_id))
        second = await _open(stub)  # the slot was released
        assert second.session_id != first.session_id


def test_keepalive_options() -> None:
    options = dict(GrpcHostOptions().server_options())
    assert options["grpc.keepalive_time_ms"] == 20_000
    assert options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.http2.ping_timeout_ms"] == 20_000
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 10_000
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    assert "grpc.keepalive_time_ms" not in dict(GrpcHostOptions(keepalive_time=0).server_options())


async def test_serve_grpc_runs_until_stopped(provider: LocalSessionProvider) -> None:
    stop = asyncio.Event()
    urls: list[str] = []
    serving = asyncio.ensure_future(
        serve_grpc(provider, "grpc://127.0.0.1:0", stop=stop, ready=urls.append)
    )
    while not urls:
        await asyncio.sleep(0.01)
    channel = aio.insecure_channel(urls[0].removeprefix("grpc://"))
    try:
        lease = await _open(v1_pb2_grpc.CodeModeHostStub(channel))
        assert lease.session_id
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
        await channel.close()


def test_listen_addresses() -> None:
    assert GrpcAddress.parse("grpc://127.0.0.1:0") == GrpcAddress("127.0.0.1", 0)
    assert GrpcAddress.parse("grpc://[::1]:5").url() == "grpc://[::1]:5"
    for bad in ("ws://a:1", "grpc://a", "grpc://a:1/x", "grpc://u@a:1"):
        with pytest.raises(ValueError, match="grpc"):
            GrpcAddress.parse(bad)


@pytest.mark.timeout(30)
async def test_a_client_gone_silent_loses_its_sessions_at_the_keepalive_timeout(
    provider: LocalSessionProvider,
) -> None:
    options = GrpcHostOptions(keepalive_time=0.5, keepalive_timeout=0.5)
    host = GrpcHost(provider, options=options)
    proxy = FreezingProxy(GrpcAddress.parse(await host.start()).port)
    channel = aio.insecure_channel(await proxy.start(), options=CHANNEL_OPTIONS)
    try:
        stub = v1_pb2_grpc.CodeModeHostStub(channel)
        lease = await _open(stub)
        call = _execute(stub, lease, "while (true) {}", yield_time_ms=600_000)
        await _started(call)
        assert (host.sessions, host.active_cells) == (1, 1)
        proxy.frozen.set()  # neither side hears from the other again; no socket closes
        loop = asyncio.get_running_loop()
        started = loop.time()
        while host.sessions or host.active_cells:
            assert loop.time() - started < 5.0, "the silent client's session was still open"
            await asyncio.sleep(0.05)
        # A ping every 0.5 s, its ack due within 0.5 s: about a second.
        assert loop.time() - started < 3.0
    finally:
        await proxy.aclose()
        await channel.close(grace=None)
        await host.aclose()


async def _count_until_closed(lease: Lease, cells: int, *kinds: str) -> dict[str, int]:
    """Read the lease until ``cells`` cells closed (and a moment after); how many events of
    each of ``kinds`` came."""
    counts = dict.fromkeys(kinds, 0)
    closed = 0
    while closed < cells:
        kind = (await lease.next()).WhichOneof("event")
        closed += kind == "cell_closed"
        if kind in counts:
            counts[kind] += 1
    with contextlib.suppress(TimeoutError):
        while True:
            kind = (await lease.next(0.5)).WhichOneof("event")
            if kind in counts:
                counts[kind] += 1
    return counts


@pytest.mark.timeout(60)
async def test_calls_revoked_while_their_subscriber_does_not_read_are_never_written(
    provider: LocalSessionProvider,
) -> None:
    """Finding: a subscriber that does not read keeps the host's queue of its tool calls; a call
    revoked there (its cell ended) stayed queued with its input until the subscriber's turn came:
    9 cells that each made a 20 MB call and ended held 180 M characters in a host whose client
    read nothing. Now a revoked call leaves the queue at once, is never written, and has no
    cancellation: the client never saw it."""
    host = GrpcHost(provider, "grpc://127.0.0.1:0")
    async with _served(host) as stub:
        lease = await _open(stub)
        subscription = stub.SubscribeToToolCalls(
            pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
        )
        await subscription.initial_metadata()
        big = 8 << 20
        calls = [
            _execute(
                stub,
                lease,
                f"await new Promise(r => setTimeout(r, {i * 100})); "
                f'tools.echo({{s: "x".repeat({big})}}); text("end")',
                tools=(ECHO,),
            )
            for i in range(6)
        ]
        for call in calls:
            await _started(call)
            outcome = await _outcome(call)
            assert _texts(outcome) == ["end"]
        (session,) = host._sessions.values()
        assert len(session.subscriptions[0].queue) == 0
        # Read now: what was already on its way arrives, and only that is cancelled.
        received = []
        with contextlib.suppress(TimeoutError):
            while True:
                received.append(await asyncio.wait_for(subscription.read(), 1.0))
        assert len(received) < len(calls)  # the subscriber read none while they were made
        counts = await _count_until_closed(lease, len(calls), "tool_call_cancelled")
        assert counts == {"tool_call_cancelled": len(received)}
        subscription.cancel()


@pytest.mark.timeout(60)
async def test_notifications_revoked_before_their_lease_wrote_them_are_never_written(
    provider: LocalSessionProvider,
) -> None:
    """The lease's own queue: a notification revoked (its cell terminated) while the client did
    not read the lease stayed queued with its text, and was written later, before its cancel;
    cells that notified 1,000 times each and were terminated left 2,000 events each on the
    lease. Now a notification not written yet is let go with nothing in its place, and no
    cancellation follows it: the client never saw it."""
    host = GrpcHost(provider, "grpc://127.0.0.1:0")
    async with _served(host) as stub:
        lease = await _open(stub)
        big = 8 << 20
        sources = [f'notify("x".repeat({big})); await new Promise(() => {{}})'] * 3
        sources.append(
            'for (let i = 0; i < 1000; i++) notify("n" + i); await new Promise(() => {})'
        )
        cells = []
        for source in sources:
            call = _execute(stub, lease, source, yield_time_ms=100)
            started = await _started(call)
            assert (await _outcome(call)).WhichOneof("outcome") == "yielded"
            cells.append(started.cell_id)
        for cell_id in cells:
            response = await stub.Terminate(
                pb.TerminateRequest(session_id=lease.session_id, cell_id=cell_id)
            )
            assert response.live_cell.WhichOneof("outcome") == "terminated"
        (session,) = host._sessions.values()
        assert len(session.lease) < 3 + len(cells)  # what went out before, and the cells' closing
        counts = await _count_until_closed(
            lease, len(cells), "notification", "notification_cancelled"
        )
        # What was already on its way when the client stopped reading, and its cancellation.
        assert counts["notification"] <= 1
        assert counts["notification_cancelled"] == counts["notification"]


async def test_a_session_holds_a_bounded_number_of_subscriptions(stub: Stub) -> None:
    """Finding: a session's tool-call subscriptions were unbounded (5,000 of one session took the
    host 250 MiB); past the bound one is refused, and a slot frees when one ends."""
    lease = await _open(stub)
    request = pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    subscriptions = [
        stub.SubscribeToToolCalls(request) for _ in range(MAX_SUBSCRIPTIONS_PER_SESSION)
    ]
    for subscription in subscriptions:
        await subscription.initial_metadata()
    refused = stub.SubscribeToToolCalls(request)
    error = await _status(asyncio.wait_for(refused.read(), 10))
    assert (error.code(), error.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        texts.SESSION_TOO_MANY_SUBSCRIPTIONS,
    )
    subscriptions.pop().cancel()
    call = _execute(stub, lease, "text(1)")
    await _started(call)
    assert _texts(await _outcome(call)) == ["1"]  # the session goes on
    for _ in range(50):
        again = stub.SubscribeToToolCalls(request)
        try:
            await asyncio.wait_for(again.initial_metadata(), 5)
            break
        except aio.AioRpcError:  # the cancelled one may not have been let go yet
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("no slot came free")


async def test_a_sessions_subscriptions_name_a_bounded_number_of_tools(stub: Stub) -> None:
    """Finding: a subscription's tool names were unbounded: 64 MiB of short names (7 million)
    held the event loop 6 s while the filter was built and took the host 1.7 GiB, 64 times per
    session. Past the bound (all of a session's subscriptions together) one is refused before
    anything is built from its names; a filter without names still opens."""
    lease = await _open(stub)

    def names(count: int, prefix: str) -> list[pb.ToolName]:
        return [pb.ToolName(name=f"{prefix}{index}") for index in range(count)]

    half = MAX_SUBSCRIBED_TOOL_NAMES // 2
    first = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id, tool_names=names(half, "a"))
    )
    await asyncio.wait_for(first.initial_metadata(), 10)
    for count in (MAX_SUBSCRIBED_TOOL_NAMES - half + 1, 1_000_000):
        refused = stub.SubscribeToToolCalls(
            pb.SubscribeToToolCallsRequest(
                session_id=lease.session_id, tool_names=names(count, "b")
            )
        )
        error = await _status(asyncio.wait_for(refused.read(), 30))
        assert (error.code(), error.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            texts.SESSION_TOO_MANY_SUBSCRIBED_TOOLS,
        )
    rest = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(
            session_id=lease.session_id,
            tool_names=[
                *names(MAX_SUBSCRIBED_TOOL_NAMES - half - 1, "c"),
                pb.ToolName(name="echo"),
            ],
        )
    )
    everything = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    for subscription in (rest, everything):
        await asyncio.wait_for(subscription.initial_metadata(), 10)
    call = _execute(stub, lease, "text(await tools.echo(1))", tools=(ECHO,))
    await _started(call)
    tool_call = await asyncio.wait_for(rest.read(), 10)  # routed by its filter
    await _succeed(stub, lease, tool_call.invocation_id, b'"ok"')
    assert _texts(await _outcome(call)) == ["ok"]


# -- large inputs ---------------------------------------------------------------------------------


async def test_a_long_tool_input_is_encoded_off_the_loop(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Escaped text encodes at 250-500 MB/s: an input of millions of backslashes is written a
    # piece at a time on a worker thread (decision 0022), never by one encode on the loop.
    watched = watch_encoders(monkeypatch, strict_json)
    lease = await _open(stub)
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    source = (
        "const big = '\\\\'.repeat(3 * 1024 * 1024);"
        "const small = tools.echo({ value: 'small' });"
        "text(await tools.echo({ value: big, n: [1, null] })); await small;"
    )
    call = _execute(stub, lease, source, tools=(ECHO,))
    await _started(call)
    calls = [await asyncio.wait_for(subscription.read(), 10) for _ in range(2)]
    inputs = {c.runtime_tool_call_id: json.loads(c.input_json) for c in calls}
    assert inputs == {
        "tool-1": {"value": "small"},
        "tool-2": {"value": "\\" * (3 * 1024 * 1024), "n": [1, None]},
    }
    for tool_call in calls:
        await _succeed(stub, lease, tool_call.invocation_id, b'"ok"')
    assert _texts(await _outcome(call)) == ["ok"]
    assert watched.longest < 1024  # the long input never went through the loop's encoder
