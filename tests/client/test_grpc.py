"""The gRPC client (``grpc.md`` §4-§13) against an in-process host and a scripted fake host."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpc import StatusCode, aio

from codemode.client.grpc import GrpcCodeModeSessionProvider, GrpcSession, parse_endpoint
from codemode.errors import CodeModeError, ConnectionClosed
from codemode.grpc_stubs import v1_pb2_grpc
from codemode.host.grpc import GrpcHost
from codemode.protocol.grpc import texts
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    ToolDefinition,
    ToolName,
    WaitOutcome,
    WaitRequest,
    Yielded,
)
from codemode.runtime import LocalSessionProvider
from codemode.runtime.session import LocalSession
from codemode.session import CancellationToken, CodeModeSessionDelegate
from tests.polling import eventually

ECHO = ToolDefinition("echo", ToolName("echo"), "echo")


class Delegate(CodeModeSessionDelegate):
    def __init__(self) -> None:
        self.calls: list[CodeModeNestedToolCall] = []
        self.notes: list[tuple[str, str, str]] = []
        self.closed: list[str] = []

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.calls.append(invocation)
        return {"echo": invocation.input}

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        self.notes.append((call_id, cell_id.value, text))

    def cell_closed(self, cell_id: CellId) -> None:
        self.closed.append(cell_id.value)


@pytest.fixture
async def host() -> AsyncIterator[GrpcHost]:
    async with LocalSessionProvider() as provider:
        instance = GrpcHost(provider, "grpc://127.0.0.1:0")
        await instance.start()
        try:
            yield instance
        finally:
            await instance.aclose()


@pytest.fixture
async def client(host: GrpcHost) -> AsyncIterator[GrpcCodeModeSessionProvider]:
    provider = GrpcCodeModeSessionProvider(host.url)
    try:
        yield provider
    finally:
        await provider.aclose()


def test_endpoints() -> None:
    assert parse_endpoint("grpc://127.0.0.1:5") == "127.0.0.1:5"
    assert parse_endpoint("http://localhost:7") == "localhost:7"
    assert parse_endpoint("unix:///tmp/s") == "unix:///tmp/s"
    with pytest.raises(CodeModeError) as caught:
        parse_endpoint("http://alice:secret@127.0.0.1:5")
    assert "must not include credentials" in str(caught.value)
    assert "alice" not in str(caught.value) and "secret" not in str(caught.value)


async def test_tool_call_notification_and_closure(client: GrpcCodeModeSessionProvider) -> None:
    delegate = Delegate()
    session = await client.create_session(delegate)
    started = await session.execute(
        ExecuteRequest(
            "call-1",
            'notify("note"); text(JSON.stringify(await tools.echo({v: 1})))',
            [ECHO],
        )
    )
    response = await started.initial_response()
    assert response == Result(started.cell_id, [InputText('{"echo":{"v":1}}')])
    assert delegate.notes == [("call-1", "1", "note")]
    assert delegate.calls[0].runtime_tool_call_id == "tool-1"
    await eventually(lambda: delegate.closed == ["1"])
    await session.shutdown()
    assert delegate.closed == ["1"]
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", "text(1)"))
    assert str(caught.value) == "code mode session is shutting down"


async def test_cancelled_wait_retires_before_the_next(client: GrpcCodeModeSessionProvider) -> None:
    session = await client.create_session(Delegate())
    started = await session.execute(
        ExecuteRequest("c", "await new Promise(r => setTimeout(r, 100000))", yield_time_ms=1)
    )
    assert isinstance(await started.initial_response(), Yielded)
    waiting = asyncio.create_task(session.wait(WaitRequest(started.cell_id, 60_000)))
    await asyncio.sleep(0.2)
    with pytest.raises(CodeModeError) as caught:
        await session.wait(WaitRequest(started.cell_id, 10))
    assert str(caught.value) == f"exec cell {started.cell_id} already has an active observer"
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    outcome = await session.wait(WaitRequest(started.cell_id, 10))
    assert outcome == LiveCell(Yielded(started.cell_id, []))
    await session.shutdown()


async def test_started_cell_yields_early_over_grpc(client: GrpcCodeModeSessionProvider) -> None:
    """``StartedCell.yield_early()`` sends ``YieldObservation{execution_id}``: the initial
    response is ``Yielded`` with what the cell wrote, the cell goes on."""
    session = await client.create_session(Delegate())
    started = await session.execute(
        ExecuteRequest(
            "c", 'text("a"); await new Promise(r => setTimeout(r, 300)); text("b")', [], 60_000
        )
    )
    await asyncio.sleep(0.1)
    started.yield_early()
    assert await asyncio.wait_for(started.initial_response(), 10) == Yielded(
        started.cell_id, [InputText("a")]
    )
    outcome = await session.wait(WaitRequest(started.cell_id, 10_000))
    assert outcome == LiveCell(Result(started.cell_id, [InputText("b")]))
    await session.shutdown()


async def test_host_death_fails_pending_calls_promptly(host: GrpcHost) -> None:
    provider = GrpcCodeModeSessionProvider(host.url)
    delegate = Delegate()
    session = await provider.create_session(delegate)
    started = await session.execute(
        ExecuteRequest("c", "await new Promise(() => {})", yield_time_ms=1)
    )
    await started.initial_response()
    waiting = asyncio.create_task(session.wait(WaitRequest(started.cell_id, 60_000)))
    await asyncio.sleep(0.2)
    began = time.monotonic()
    await host.aclose()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - began < 5
    assert not session.is_alive()
    assert delegate.closed == [started.cell_id.value]
    # The next execute tries to reconnect (§13.8): the host is gone, so opening fails.
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", "text(1)"))
    assert str(caught.value).startswith("gRPC code-mode session opening failed: UNAVAILABLE: ")
    await session.shutdown()
    await provider.aclose()


# -- a scripted host ---------------------------------------------------------------------------

SESSION = str(uuid.uuid4())


class Fake(v1_pb2_grpc.CodeModeHostServicer):
    """Opens one session; each test scripts what Execute and the streams send."""

    def __init__(self) -> None:
        self.first: pb.SessionEvent | None = pb.SessionEvent(
            opened=pb.SessionOpened(session_id=SESSION)
        )
        self.lease: asyncio.Queue[pb.SessionEvent] = asyncio.Queue()
        self.calls: asyncio.Queue[pb.ToolCall] = asyncio.Queue()
        self.completions: list[pb.CompleteToolCallRequest] = []
        self.acks: list[str] = []
        self.execute: Any = None

    async def OpenSession(self, request: Any, context: Any) -> AsyncIterator[pb.SessionEvent]:
        if self.first is None:
            return
        yield self.first
        while True:
            yield await self.lease.get()

    async def SubscribeToToolCalls(self, request: Any, context: Any) -> AsyncIterator[pb.ToolCall]:
        while True:
            yield await self.calls.get()

    async def CompleteToolCall(self, request: Any, context: Any) -> Any:
        self.completions.append(request)
        return pb.CompleteToolCallResponse()

    async def AcknowledgeNotification(self, request: Any, context: Any) -> Any:
        self.acks.append(request.notification_id)
        return pb.AcknowledgeNotificationResponse()

    async def CloseSession(self, request: Any, context: Any) -> Any:
        return pb.CloseSessionResponse()

    async def Execute(self, request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        async for event in self.execute(request):
            yield event

    async def Wait(self, request: Any, context: Any) -> Any:
        await context.abort(StatusCode.UNIMPLEMENTED, "not scripted")

    async def Terminate(self, request: Any, context: Any) -> Any:
        await context.abort(StatusCode.UNIMPLEMENTED, "not scripted")

    async def CancelWait(self, request: Any, context: Any) -> Any:
        return pb.CancelWaitResponse()

    async def YieldObservation(self, request: Any, context: Any) -> Any:
        return pb.YieldObservationResponse()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, GrpcCodeModeSessionProvider]]:
    servicer = Fake()
    server = aio.server()
    v1_pb2_grpc.add_CodeModeHostServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    provider = GrpcCodeModeSessionProvider(f"grpc://127.0.0.1:{port}")
    try:
        yield servicer, provider
    finally:
        await provider.aclose()
        await server.stop(0)


def started(request: Any, cell: str = "1", execution_id: str | None = None) -> pb.ExecuteEvent:
    return pb.ExecuteEvent(
        started=pb.ExecutionStarted(execution_id=execution_id or request.execution_id, cell_id=cell)
    )


def completed(cell: str = "1") -> pb.ExecuteEvent:
    outcome = pb.ExecutionOutcome(cell_id=cell)
    outcome.completed.SetInParent()
    return pb.ExecuteEvent(outcome=outcome)


async def test_lease_must_open_first(fake: tuple[Fake, GrpcCodeModeSessionProvider]) -> None:
    servicer, provider = fake
    servicer.first = pb.SessionEvent(cell_closed=pb.CellClosed())
    with pytest.raises(CodeModeError) as caught:
        await provider.create_session(Delegate())
    assert str(caught.value) == texts.LEASE_OMITTED_OPENING
    servicer.first = None
    with pytest.raises(CodeModeError) as caught:
        await provider.create_session(Delegate())
    assert str(caught.value) == texts.LEASE_ENDED_BEFORE_OPENING


async def test_execute_violations(fake: tuple[Fake, GrpcCodeModeSessionProvider]) -> None:
    servicer, provider = fake
    session = await provider.create_session(Delegate())

    async def ends(request: Any) -> AsyncIterator[pb.ExecuteEvent]:
        return
        yield

    servicer.execute = ends
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value) == texts.EXECUTION_ENDED_BEFORE_STARTING

    async def outcome_first(request: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield completed()

    servicer.execute = outcome_first
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value) == texts.EXECUTION_OMITTED_STARTING

    async def no_outcome(request: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield started(request)

    servicer.execute = no_outcome
    cell = await session.execute(ExecuteRequest("c", ""))
    with pytest.raises(CodeModeError) as caught:
        await cell.initial_response()
    assert str(caught.value) == texts.EXECUTION_OMITTED_INITIAL_OUTCOME
    assert session.is_alive()

    async def wrong_cell(request: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield started(request, "7")
        yield completed("8")

    servicer.execute = wrong_cell
    cell = await session.execute(ExecuteRequest("c", ""))
    with pytest.raises(ConnectionClosed) as caught:
        await cell.initial_response()
    assert str(caught.value) == texts.execution_returned_cell("8", "7")
    assert not session.is_alive()


async def test_wrong_execution_id_fails_the_session(
    fake: tuple[Fake, GrpcCodeModeSessionProvider],
) -> None:
    servicer, provider = fake
    session = await provider.create_session(Delegate())

    async def other(request: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield started(request, execution_id="other")

    servicer.execute = other
    with pytest.raises(ConnectionClosed) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value).startswith("gRPC code-mode execution returned ID other instead of ")
    assert not session.is_alive()


def tool_call(execution_id: str, invocation_id: str, cell: str = "1") -> pb.ToolCall:
    return pb.ToolCall(
        session_id=SESSION,
        execution_id=execution_id,
        cell_id=cell,
        invocation_id=invocation_id,
        runtime_tool_call_id="tool-1",
        tool_name=pb.ToolName(name="echo"),
        tool_kind=pb.TOOL_KIND_FUNCTION,
        input_json=b'{"a":1}',
        sequence=1,
    )


async def test_tool_calls_closed_cells_and_early_cancellation(
    fake: tuple[Fake, GrpcCodeModeSessionProvider],
) -> None:
    servicer, provider = fake
    delegate = Delegate()
    session = await provider.create_session(delegate)
    assert isinstance(session, GrpcSession)
    release = asyncio.Event()
    seen: list[str] = []

    async def script(request: Any) -> AsyncIterator[pb.ExecuteEvent]:
        seen.append(request.execution_id)
        yield started(request)
        await release.wait()
        yield completed()

    servicer.execute = script
    cell = await session.execute(ExecuteRequest("c", "", [ECHO]))
    execution_id = seen[0]
    # A round trip.
    first = str(uuid.uuid4())
    await servicer.calls.put(tool_call(execution_id, first))
    await eventually(lambda: servicer.completions)
    assert servicer.completions[0].invocation_id == first
    assert servicer.completions[0].succeeded.output_json == b'{"echo":{"a":1}}'
    # A cancellation that overtakes its ToolCall: never answered.
    early = str(uuid.uuid4())
    await servicer.lease.put(
        pb.SessionEvent(tool_call_cancelled=pb.ToolCallCancelled(invocation_id=early))
    )
    await asyncio.sleep(0.1)
    await servicer.calls.put(tool_call(execution_id, early))
    # A notification is delivered, then acknowledged.
    note = str(uuid.uuid4())
    await servicer.lease.put(
        pb.SessionEvent(
            notification=pb.Notification(
                notification_id=note, execution_id=execution_id, cell_id="1", call_id="c", text="t"
            )
        )
    )
    await eventually(lambda: servicer.acks == [note])
    assert delegate.notes == [("c", "1", "t")]
    # After CellClosed a ToolCall of that execution is answered closed, the cell released once.
    await servicer.lease.put(
        pb.SessionEvent(cell_closed=pb.CellClosed(execution_id=execution_id, cell_id="1"))
    )
    await eventually(lambda: delegate.closed == ["1"])
    late = str(uuid.uuid4())
    await servicer.calls.put(tool_call(execution_id, late))
    await eventually(lambda: len(servicer.completions) == 2)
    assert servicer.completions[1].invocation_id == late
    assert servicer.completions[1].failed.message == texts.cell_is_closed("1")
    release.set()
    assert await cell.initial_response() == Result(CellId("1"), [])
    assert session.is_alive()
    await session.shutdown()
    assert delegate.closed == ["1"]


async def test_bad_session_events_fail_the_session(
    fake: tuple[Fake, GrpcCodeModeSessionProvider],
) -> None:
    servicer, provider = fake
    session = await provider.create_session(Delegate())
    await servicer.lease.put(pb.SessionEvent())
    await eventually(lambda: not session.is_alive())
    assert session.failure == texts.LEASE_EMPTY_EVENT
    # A call created before the reconnect reports the replacement (§13.8).
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value) == texts.RUNTIME_REPLACED


async def _host_process(port: int) -> tuple[asyncio.subprocess.Process, str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "codemode",
        "host",
        "--listen",
        f"grpc://127.0.0.1:{port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert child.stdout is not None
    url = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip()
    assert url.startswith("grpc://127.0.0.1:"), url
    return child, url


class _TerminatingTwice(LocalSessionProvider):
    """The embedded runtime, whose terminate answers as a second terminate during the first's
    cleanup does (``exec cell ⟨id⟩ is already terminating``), deterministically."""

    async def create_session_with_limits(
        self, delegate: CodeModeSessionDelegate, limits: CodeModeSessionCellExecutionLimits
    ) -> LocalSession:
        session = await super().create_session_with_limits(delegate, limits)

        async def terminate(cell_id: CellId) -> WaitOutcome:
            raise CodeModeError(f"exec cell {cell_id} is already terminating")

        session.terminate = terminate  # type: ignore[method-assign]
        return session


@pytest.mark.timeout(60)
async def test_later_generations_name_public_ids_in_the_hosts_cell_texts() -> None:
    """§13.8: after a reconnect, the host's fixed texts that name a cell (§12.2's passed-through
    errors, a missing cell's error text) name its public id, as the client's own texts do."""
    async with _TerminatingTwice() as runtime:
        host = GrpcHost(runtime, "grpc://127.0.0.1:0")
        await host.start()
        provider = GrpcCodeModeSessionProvider(host.url)
        channel = aio.insecure_channel(host.url.removeprefix("grpc://"))
        try:
            session = await provider.create_session(Delegate())
            first = await session.execute(ExecuteRequest("c", "text(1)"))
            await first.initial_response()
            closing = pb.CloseSessionRequest(session_id=session.session_id)
            await v1_pb2_grpc.CodeModeHostStub(channel).CloseSession(closing)
            await eventually(lambda: not session.is_alive())
            with pytest.raises(CodeModeError):  # the replacement is reported once
                await session.execute(ExecuteRequest("c", "text(1)"))
            running = await session.execute(
                ExecuteRequest("c", "await new Promise(() => {})", yield_time_ms=60_000)
            )
            assert running.cell_id == CellId("g2:1")
            # The initial response is the cell's observer on the host, so a wait is refused there.
            initial = asyncio.ensure_future(running.initial_response())
            with pytest.raises(CodeModeError) as caught:
                await session.wait(WaitRequest(running.cell_id, 0))
            assert str(caught.value) == "exec cell g2:1 already has an active observer"
            with pytest.raises(CodeModeError) as caught:
                await session.terminate(running.cell_id)
            assert str(caught.value) == "exec cell g2:1 is already terminating"
            missing = await session.wait(WaitRequest(CellId("g2:99"), 10))
            assert isinstance(missing, MissingCell)
            assert missing.response.cell_id == CellId("g2:99")
            assert isinstance(missing.response, Result)
            assert missing.response.error_text == "exec cell g2:99 not found"
            initial.cancel()
        finally:
            await channel.close()
            await provider.aclose()
            await host.aclose()


@pytest.mark.timeout(90)
async def test_a_restarted_host_process_is_a_new_generation() -> None:
    """The host process is killed under a live session and started again on the same port: the
    pending wait fails, the first execute created before the reconnect reports the replacement
    (exact text), the next runs as ``g2:1`` on an empty store, and old ids are refused."""
    child, url = await _host_process(0)
    port = int(url.rsplit(":", 1)[1])
    provider = GrpcCodeModeSessionProvider(url)
    delegate = Delegate()
    try:
        session = await provider.create_session(delegate)
        stored = await session.execute(ExecuteRequest("c", 'store("k", 1); text(load("k"))'))
        assert await stored.initial_response() == Result(CellId("1"), [InputText("1")])
        running = await session.execute(
            ExecuteRequest("c", "await new Promise(() => {})", yield_time_ms=1)
        )
        await running.initial_response()
        waiting = asyncio.create_task(session.wait(WaitRequest(running.cell_id, 60_000)))
        await asyncio.sleep(0.2)
        child.kill()
        await child.wait()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(waiting, 10)
        await eventually(lambda: sorted(delegate.closed) == ["1", "2"])
        assert not session.is_alive()
        child, _ = await _host_process(port)
        with pytest.raises(CodeModeError) as caught:
            await session.execute(ExecuteRequest("c", "text(1)"))
        assert str(caught.value) == (
            "The exec runtime was replaced. Stored values and running cells were lost. Prior "
            "external tool operations may have completed; inspect their results before "
            "retrying. You may continue with a fresh exec call."
        )
        fresh = await session.execute(ExecuteRequest("c", 'text(String(load("k")))'))
        assert fresh.cell_id == CellId("g2:1")
        assert await fresh.initial_response() == Result(CellId("g2:1"), [InputText("undefined")])
        with pytest.raises(CodeModeError) as caught:
            await session.terminate(running.cell_id)
        assert str(caught.value) == texts.STALE_GENERATION
        assert session.is_alive() and session.generation == 2
        await session.shutdown()
        assert sorted(delegate.closed) == ["1", "2", "g2:1"]
    finally:
        await provider.aclose()
        if child.returncode is None:
            child.terminate()
            await child.wait()
