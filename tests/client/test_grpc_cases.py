"""Every gRPC client case of ``grpc.md`` §14.1 (client unit cases) and §14.2 (end-to-end cases).

One test per case, named ``test_cNN_⟨case⟩`` (§14.1) or ``test_eNN_⟨case⟩`` (§14.2), with the case's
wording as its docstring. Cases run against the real in-process host (:class:`GrpcHost` over
:class:`LocalSessionProvider`) where they can, and against a scripted fake host (:class:`Fake`)
where the case needs a misbehaving host. Cases the client does not implement yet are strict xfails
saying what is missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import contextlib
import gc
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
import pytest
from grpc import StatusCode, aio

import codemode.client.grpc as client_grpc
from codemode.client.grpc import GrpcCodeModeSessionProvider, GrpcSession, parse_endpoint
from codemode.errors import CodeModeError, ConnectionClosed
from codemode.grpc_stubs import v1_pb2_grpc
from codemode.host.grpc import GrpcHost
from codemode.protocol.grpc import conversions, texts
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import MAX_TOOL_ERROR_MESSAGE_BYTES
from codemode.protocol.texts import SESSION_SHUTTING_DOWN, TOO_MANY_CALLBACKS
from codemode.protocol.types import (
    JSON,
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
from codemode.runtime import LocalSessionProvider
from codemode.session import CancellationToken, CodeModeSessionDelegate, StartedCell
from tests.polling import eventually

ECHO = ToolDefinition("echo", ToolName("echo"), "echo")
FOREVER = "await new Promise(() => {})"


#: Started cells a test keeps alive: dropping a StartedCell abandons its cell (its later tool
#: calls are then answered closed), which is not what those tests are about.
KEPT: list[StartedCell] = []


@pytest.fixture(autouse=True)
def _release_kept_cells() -> Iterator[None]:
    yield
    KEPT.clear()


# -- delegates -------------------------------------------------------------------------------------


class Delegate(CodeModeSessionDelegate):
    """Records everything; ``tool`` / ``note`` override how calls are served."""

    def __init__(self) -> None:
        self.calls: list[CodeModeNestedToolCall] = []
        self.tokens: list[CancellationToken] = []
        self.notes: list[tuple[str, str, str]] = []
        self.note_tokens: list[CancellationToken] = []
        self.closed: list[str] = []
        self.tool: Callable[[CodeModeNestedToolCall, CancellationToken], Awaitable[JSON]] | None = (
            None
        )
        self.note: Callable[[str, CancellationToken], Awaitable[None]] | None = None

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.calls.append(invocation)
        self.tokens.append(cancellation)
        if self.tool is not None:
            return await self.tool(invocation, cancellation)
        return {"echo": invocation.input}

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        self.notes.append((call_id, cell_id.value, text))
        self.note_tokens.append(cancellation)
        if self.note is not None:
            await self.note(text, cancellation)

    def cell_closed(self, cell_id: CellId) -> None:
        self.closed.append(cell_id.value)


async def cancelled(token: CancellationToken) -> None:
    while not token.is_cancelled():
        await asyncio.sleep(0.01)


# -- the real host ---------------------------------------------------------------------------------


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


# -- a scripted host -------------------------------------------------------------------------------


@dataclass(eq=False)
class Lease:
    """One opened session of the fake: its id and the queues of its two streams."""

    session_id: str
    events: asyncio.Queue[pb.SessionEvent | None] = field(default_factory=asyncio.Queue)
    calls: asyncio.Queue[pb.ToolCall] = field(default_factory=asyncio.Queue)
    executions: list[pb.ExecuteRequest] = field(default_factory=list)
    completions: list[pb.CompleteToolCallRequest] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)


Script = Callable[[Any, Any], AsyncIterator[pb.ExecuteEvent]]


class Fake(v1_pb2_grpc.CodeModeHostServicer):
    """Opens sessions with fresh ids; each test scripts Execute, Wait, Terminate and failures."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.open_attempts = 0
        self.open_failures: list[tuple[StatusCode, str]] = []
        self.open_hangs = 0
        self.routed = False
        self.open_routes: list[str | None] = []
        self.execute: Script | None = None
        self.wait: Callable[[Any, Any], Awaitable[pb.WaitResponse]] | None = None
        self.terminate: Callable[[Any, Any], Awaitable[pb.WaitResponse]] | None = None
        self.complete: Callable[[Any, Any], Awaitable[None]] | None = None

    def lease(self, session_id: str) -> Lease:
        return next(lease for lease in self.leases if lease.session_id == session_id)

    async def OpenSession(self, request: Any, context: Any) -> AsyncIterator[pb.SessionEvent]:
        self.open_attempts += 1
        self.open_routes.append(dict(context.invocation_metadata()).get("x-code-mode-route"))
        if self.routed:
            await context.send_initial_metadata((("x-code-mode-route", f"r{self.open_attempts}"),))
        if self.open_failures:
            code, message = self.open_failures.pop(0)
            await context.abort(code, message)
        if self.open_hangs:
            self.open_hangs -= 1
            await asyncio.sleep(3600)
        lease = Lease(str(uuid.uuid4()))
        self.leases.append(lease)
        yield pb.SessionEvent(opened=pb.SessionOpened(session_id=lease.session_id))
        while (event := await lease.events.get()) is not None:
            yield event

    async def SubscribeToToolCalls(self, request: Any, context: Any) -> AsyncIterator[pb.ToolCall]:
        lease = self.lease(request.session_id)
        while True:
            yield await lease.calls.get()

    async def CompleteToolCall(self, request: Any, context: Any) -> Any:
        self.lease(request.session_id).completions.append(request)
        if self.complete is not None:
            await self.complete(request, context)
        return pb.CompleteToolCallResponse()

    async def AcknowledgeNotification(self, request: Any, context: Any) -> Any:
        self.lease(request.session_id).acks.append(request.notification_id)
        return pb.AcknowledgeNotificationResponse()

    async def CloseSession(self, request: Any, context: Any) -> Any:
        with contextlib.suppress(StopIteration):
            await self.lease(request.session_id).events.put(None)
        return pb.CloseSessionResponse()

    async def Execute(self, request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        self.lease(request.session_id).executions.append(request)
        assert self.execute is not None, "Execute not scripted"
        async for event in self.execute(request, context):
            yield event

    async def Wait(self, request: Any, context: Any) -> Any:
        if self.wait is None:
            await context.abort(StatusCode.UNIMPLEMENTED, "not scripted")
        assert self.wait is not None
        return await self.wait(request, context)

    async def Terminate(self, request: Any, context: Any) -> Any:
        if self.terminate is None:
            await context.abort(StatusCode.UNIMPLEMENTED, "not scripted")
        assert self.terminate is not None
        return await self.terminate(request, context)

    async def CancelWait(self, request: Any, context: Any) -> Any:
        return pb.CancelWaitResponse()

    async def YieldObservation(self, request: Any, context: Any) -> Any:
        return pb.YieldObservationResponse()


@dataclass
class Scripted:
    fake: Fake
    provider: GrpcCodeModeSessionProvider
    port: int

    def respond_within(self, response_timeout: float) -> None:
        """Open the next sessions with this ``response_timeout`` (seconds, default 60)."""
        self.provider = GrpcCodeModeSessionProvider(
            f"grpc://127.0.0.1:{self.port}", response_timeout=response_timeout
        )

    async def open(self, delegate: Delegate) -> tuple[GrpcSession, Lease]:
        session = await self.provider.create_session(delegate)
        return session, self.fake.lease(session.session_id)


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    fake = Fake()
    server = aio.server()
    v1_pb2_grpc.add_CodeModeHostServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    provider = GrpcCodeModeSessionProvider(f"grpc://127.0.0.1:{port}")
    instance = Scripted(fake, provider, port)
    try:
        yield instance
    finally:
        await provider.aclose()
        if instance.provider is not provider:
            await instance.provider.aclose()
        await server.stop(0)


def started_event(request: Any, cell: str = "1") -> pb.ExecuteEvent:
    return pb.ExecuteEvent(
        started=pb.ExecutionStarted(execution_id=request.execution_id, cell_id=cell)
    )


def outcome(cell: str, kind: str = "completed", items: list[pb.ContentItem] | None = None) -> Any:
    result = pb.ExecutionOutcome(cell_id=cell, content_items=items or [])
    getattr(result, kind).SetInParent()
    return result


def starts_then(cell: str = "1", gate: asyncio.Event | None = None) -> Script:
    """An Execute that starts ``cell`` and completes it once ``gate`` is set (never if None)."""

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield started_event(request, cell)
        if gate is None:
            await asyncio.sleep(3600)
        else:
            await gate.wait()
        yield pb.ExecuteEvent(outcome=outcome(cell))

    return script


def tool_call(
    lease: Lease,
    execution_id: str,
    invocation_id: str | None = None,
    *,
    cell: str = "1",
    name: str = "echo",
    namespace: str | None = None,
    kind: int = pb.TOOL_KIND_FUNCTION,
) -> pb.ToolCall:
    tool_name = pb.ToolName(name=name)
    if namespace is not None:
        tool_name.namespace = namespace
    return pb.ToolCall(
        session_id=lease.session_id,
        execution_id=execution_id,
        cell_id=cell,
        invocation_id=invocation_id or str(uuid.uuid4()),
        runtime_tool_call_id="tool-1",
        tool_name=tool_name,
        tool_kind=kind,  # type: ignore[arg-type]
        input_json=b'{"a":1}',
        sequence=1,
    )


def notification(
    execution_id: str, notification_id: str | None = None, *, call_id: str = "c", cell: str = "1"
) -> pb.SessionEvent:
    return pb.SessionEvent(
        notification=pb.Notification(
            notification_id=notification_id or str(uuid.uuid4()),
            execution_id=execution_id,
            cell_id=cell,
            call_id=call_id,
            text="t",
        )
    )


def cell_closed(execution_id: str, cell: str = "1") -> pb.SessionEvent:
    return pb.SessionEvent(cell_closed=pb.CellClosed(execution_id=execution_id, cell_id=cell))


def tool_call_cancelled(invocation_id: str) -> pb.SessionEvent:
    return pb.SessionEvent(tool_call_cancelled=pb.ToolCallCancelled(invocation_id=invocation_id))


def answered(lease: Lease, invocation_id: str) -> bool:
    return any(c.invocation_id == invocation_id for c in lease.completions)


async def fails_with(session: GrpcSession, text: str) -> None:
    await eventually(lambda: not session.is_alive())
    assert session.failure == text


async def reconnect_to_generation_two(scripted: Scripted, delegate: Delegate) -> GrpcSession:
    """A session whose first Execute gets ``NOT_FOUND`` (§12.2: the session is gone); §13.8 says
    the next execute reports the replacement and the one after runs on generation 2."""
    fake = scripted.fake
    session, _ = await scripted.open(delegate)
    calls = 0

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await context.abort(StatusCode.NOT_FOUND, "unknown code-mode session")
        yield started_event(request, "42")
        yield pb.ExecuteEvent(outcome=outcome("42"))

    fake.execute = script
    with pytest.raises(CodeModeError):
        await session.execute(ExecuteRequest("c", ""))
    with pytest.raises(CodeModeError):  # the replacement is reported once
        await session.execute(ExecuteRequest("c", ""))
    return session


# == §14.1 Generation mapping ========================================================================


async def test_c01_first_generation_preserves_existing_cell_ids(scripted: Scripted) -> None:
    """`first_generation_preserves_existing_cell_ids` — generation 1: wire `42` ↔ public `42`."""
    session, _ = await scripted.open(Delegate())
    scripted.fake.execute = starts_then("42", asyncio.Event())
    waited: list[str] = []

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        waited.append(request.cell_id)
        return pb.WaitResponse(live_cell=outcome(request.cell_id, "yielded"))

    scripted.fake.wait = wait
    started = await session.execute(ExecuteRequest("c", ""))
    assert started.cell_id == CellId("42")
    assert await session.wait(WaitRequest(CellId("42"), 1)) == LiveCell(Yielded(CellId("42"), []))
    assert waited == ["42"]


async def test_c02_first_generation_preserves_opaque_cell_ids_that_resemble_generation_prefixes(
    scripted: Scripted,
) -> None:
    """`first_generation_preserves_opaque_cell_ids_that_resemble_generation_prefixes` —
    generation 1 leaves `graphics:1` and `g2:42` unchanged both ways."""
    session, _ = await scripted.open(Delegate())
    waited: list[str] = []

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        waited.append(request.cell_id)
        return pb.WaitResponse(live_cell=outcome(request.cell_id, "yielded"))

    scripted.fake.wait = wait
    for cell in ("graphics:1", "g2:42"):
        scripted.fake.execute = starts_then(cell, asyncio.Event())
        started = await session.execute(ExecuteRequest("c", ""))
        assert started.cell_id == CellId(cell)
        outcome_ = await session.wait(WaitRequest(CellId(cell), 1))
        assert outcome_ == LiveCell(Yielded(CellId(cell), []))
    assert waited == ["graphics:1", "g2:42"]


async def test_c03_later_generations_prefix_public_ids_and_strip_wire_ids(
    scripted: Scripted,
) -> None:
    """`later_generations_prefix_public_ids_and_strip_wire_ids` — generation 2: wire `42` ↔
    public `g2:42`."""
    session = await reconnect_to_generation_two(scripted, Delegate())
    started = await session.execute(ExecuteRequest("c", ""))
    assert started.cell_id == CellId("g2:42")
    assert scripted.fake.leases[-1].executions[-1].execution_id


async def test_c04_stale_generation_ids_are_rejected_after_reconnection(
    scripted: Scripted,
) -> None:
    """`stale_generation_ids_are_rejected_after_reconnection` — generation 2 rejects `42`,
    `g1:42`, `g3:42` and a 10 000-character id with the stale-generation error."""
    session = await reconnect_to_generation_two(scripted, Delegate())
    await session.execute(ExecuteRequest("c", ""))
    for cell in ("42", "g1:42", "g3:42", "x" * 10_000):
        with pytest.raises(CodeModeError) as caught:
            await session.wait(WaitRequest(CellId(cell), 1))
        assert "stale code-mode host generation" in str(caught.value)


async def test_c05_reconnect_maps_every_delegate_callback_to_its_generation(
    scripted: Scripted,
) -> None:
    """`reconnect_maps_every_delegate_callback_to_its_generation` — `invoke_tool`, `notify` and
    `cell_closed` from generation 2 reach the caller's delegate with `g2:42`."""
    delegate = Delegate()
    session = await reconnect_to_generation_two(scripted, delegate)
    scripted.fake.execute = starts_then("42", asyncio.Event())
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    lease = scripted.fake.leases[-1]
    execution_id = lease.executions[-1].execution_id
    await lease.calls.put(tool_call(lease, execution_id, cell="42"))
    await eventually(lambda: delegate.calls)  # the subscription is another stream than the lease
    await lease.events.put(notification(execution_id, cell="42"))
    await lease.events.put(cell_closed(execution_id, "42"))
    await eventually(lambda: delegate.closed)
    assert delegate.calls[0].cell_id == CellId("g2:42")
    assert delegate.notes[0][1] == "g2:42"
    assert delegate.closed == ["g2:42"]


async def test_c06_reconnected_execution_maps_started_and_initial_response_ids(
    scripted: Scripted,
) -> None:
    """`reconnected_execution_maps_started_and_initial_response_ids` — started cell id and
    initial-response cell id are `g2:42`; the inner initial response is not polled before the
    caller polls."""
    session = await reconnect_to_generation_two(scripted, Delegate())
    started = await session.execute(ExecuteRequest("c", ""))
    assert started.cell_id == CellId("g2:42")
    assert (await started.initial_response()).cell_id == CellId("g2:42")


async def test_c07_reconnected_wait_maps_live_and_missing_outcomes(scripted: Scripted) -> None:
    """`reconnected_wait_maps_live_and_missing_outcomes` — both outcome kinds carry the mapped
    id."""
    session = await reconnect_to_generation_two(scripted, Delegate())
    await session.execute(ExecuteRequest("c", ""))
    state = iter(("live_cell", "missing_cell"))

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        return pb.WaitResponse(**{next(state): outcome(request.cell_id, "yielded")})

    scripted.fake.wait = wait
    assert await session.wait(WaitRequest(CellId("g2:42"), 1)) == LiveCell(
        Yielded(CellId("g2:42"), [])
    )
    assert await session.wait(WaitRequest(CellId("g2:42"), 1)) == MissingCell(
        Yielded(CellId("g2:42"), [])
    )


# == §14.1 Session state =============================================================================


async def test_c08_cell_closure_drains_notifications_and_cancels_tool_callbacks(
    scripted: Scripted,
) -> None:
    """`cell_closure_drains_notifications_and_cancels_tool_callbacks` — `CellClosed` cancels the
    admitted tool callback, leaves the notification running, a later invocation is answered
    closed, and the cell is released only after the notification finishes."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)
    release_note = asyncio.Event()

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        await cancelled(token)
        return None

    async def note(text: str, token: CancellationToken) -> None:
        await release_note.wait()

    delegate.tool, delegate.note = tool, note
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    execution_id = lease.executions[0].execution_id
    await lease.calls.put(tool_call(lease, execution_id))
    await lease.events.put(notification(execution_id))
    await eventually(lambda: delegate.calls and delegate.notes)
    await lease.events.put(cell_closed(execution_id))
    await eventually(delegate.tokens[0].is_cancelled)
    assert not delegate.note_tokens[0].is_cancelled()
    late = str(uuid.uuid4())
    await lease.calls.put(tool_call(lease, execution_id, late))
    await eventually(lambda: lease.completions)
    assert [c.invocation_id for c in lease.completions] == [late]
    assert lease.completions[0].failed.message == texts.cell_is_closed("1")
    await asyncio.sleep(0.1)
    assert delegate.closed == []
    release_note.set()
    await eventually(lambda: delegate.closed == ["1"])
    assert session.is_alive()


async def test_c09_cell_closure_waits_until_the_started_cell_is_claimed(
    scripted: Scripted,
) -> None:
    """`cell_closure_waits_until_the_started_cell_is_claimed` — an early `CellClosed` releases
    the cell only when the caller claims the started cell."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)
    gate = asyncio.Event()

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        await lease.events.put(cell_closed(request.execution_id))
        await gate.wait()
        yield started_event(request)
        yield pb.ExecuteEvent(outcome=outcome("1"))

    scripted.fake.execute = script
    executing = asyncio.create_task(session.execute(ExecuteRequest("c", "")))
    await asyncio.sleep(0.3)
    assert delegate.closed == []
    gate.set()
    started = await executing
    assert started.cell_id == CellId("1")
    await eventually(lambda: delegate.closed == ["1"])
    assert session.is_alive()


async def test_c10_oversized_cell_ids_are_rejected_before_admission(scripted: Scripted) -> None:
    """`oversized_cell_ids_are_rejected_before_admission` — a 257-byte cell id fails with
    `gRPC code-mode host returned cell ID exceeding 256 bytes` and nothing is retained."""
    delegate = Delegate()
    session, _ = await scripted.open(delegate)
    scripted.fake.execute = starts_then("x" * 257)
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value) == "gRPC code-mode host returned cell ID exceeding 256 bytes"
    binding = session._binding
    assert binding is not None
    assert binding._executions == {} and binding._cells == {}
    assert delegate.closed == []


@pytest.mark.parametrize("callback", ["tool call", "notification", "closure", "started"])
async def test_c11_callbacks_cannot_claim_another_executions_cell(
    scripted: Scripted, callback: str
) -> None:
    """`callbacks_cannot_claim_another_executions_cell` — tool call, notification, closure and
    started event naming a cell owned by another execution all fail with `code-mode host reused
    active cell ID cell`."""
    session, lease = await scripted.open(Delegate())
    scripted.fake.execute = starts_then("cell")
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    gate = asyncio.Event()

    async def second(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        if callback == "started":
            yield started_event(request, "cell")
        elif callback == "tool call":
            await lease.calls.put(tool_call(lease, request.execution_id, cell="cell"))
        elif callback == "notification":
            await lease.events.put(notification(request.execution_id, call_id="c", cell="cell"))
        else:
            await lease.events.put(cell_closed(request.execution_id, "cell"))
        await gate.wait()

    scripted.fake.execute = second
    with pytest.raises(CodeModeError) as caught:
        KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    assert str(caught.value) == "code-mode host reused active cell ID cell"
    await fails_with(session, "code-mode host reused active cell ID cell")


async def test_c12_abandonment_before_start_ignores_later_cell_closure(
    scripted: Scripted,
) -> None:
    """`abandonment_before_start_ignores_later_cell_closure` — removing an execution before it
    started makes a later `CellClosed` a no-op."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)

    async def never_starts(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        await asyncio.sleep(3600)
        yield started_event(request)

    scripted.fake.execute = never_starts
    executing = asyncio.create_task(session.execute(ExecuteRequest("c", "")))
    await eventually(lambda: lease.executions)
    executing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await executing
    await lease.events.put(cell_closed(lease.executions[0].execution_id, "1"))
    await asyncio.sleep(0.2)
    assert session.is_alive()
    scripted.fake.execute = starts_then("1", asyncio.Event())
    started = await session.execute(ExecuteRequest("c", ""))
    assert started.cell_id == CellId("1")
    assert session.is_alive()


async def test_c13_abandonment_revokes_callbacks_and_ignores_late_events(
    scripted: Scripted,
) -> None:
    """`abandonment_revokes_callbacks_and_ignores_late_events` — abandoning cancels admitted
    callbacks; a later invocation is answered closed; a later closure is ignored."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        await cancelled(token)
        return None

    delegate.tool = tool
    terminated: list[str] = []

    async def terminate(request: Any, context: Any) -> pb.WaitResponse:
        terminated.append(request.cell_id)
        return pb.WaitResponse(live_cell=outcome(request.cell_id, "terminated"))

    scripted.fake.terminate = terminate
    scripted.fake.execute = starts_then()
    started = await session.execute(ExecuteRequest("c", "", [ECHO]))
    execution_id = lease.executions[0].execution_id
    await lease.calls.put(tool_call(lease, execution_id))
    await eventually(lambda: delegate.tokens)
    started.cancel()
    await eventually(lambda: terminated == ["1"])
    await eventually(delegate.tokens[0].is_cancelled, timeout=2)
    late = str(uuid.uuid4())
    await lease.calls.put(tool_call(lease, execution_id, late))
    await eventually(lambda: lease.completions)
    assert lease.completions[0].failed.message == texts.cell_is_closed("1")
    await lease.events.put(cell_closed(execution_id))
    await asyncio.sleep(0.1)
    assert session.is_alive()


async def test_c14_invocation_cancellation_revokes_delegate_and_late_completion(
    scripted: Scripted,
) -> None:
    """`invocation_cancellation_revokes_delegate_and_late_completion` — `ToolCallCancelled` fires
    the callback's cancellation; the cell then closes normally."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        await cancelled(token)
        return "late"

    delegate.tool = tool
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    execution_id = lease.executions[0].execution_id
    invocation = str(uuid.uuid4())
    await lease.calls.put(tool_call(lease, execution_id, invocation))
    await eventually(lambda: delegate.tokens)
    await lease.events.put(tool_call_cancelled(invocation))
    await eventually(delegate.tokens[0].is_cancelled)
    await asyncio.sleep(0.1)
    assert lease.completions == []
    await lease.events.put(cell_closed(execution_id))
    await eventually(lambda: delegate.closed == ["1"])
    assert session.is_alive()


async def test_c15_duplicate_invocation_ids_are_rejected(scripted: Scripted) -> None:
    """`duplicate_invocation_ids_are_rejected` — reusing a finished invocation id is an error."""
    session, lease = await scripted.open(Delegate())
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    execution_id = lease.executions[0].execution_id
    invocation = str(uuid.uuid4())
    await lease.calls.put(tool_call(lease, execution_id, invocation))
    await eventually(lambda: lease.completions)
    await lease.calls.put(tool_call(lease, execution_id, invocation))
    await fails_with(session, texts.INVOCATION_ID_REUSED)


async def test_c16_tool_callbacks_must_match_the_executions_enabled_tools(
    scripted: Scripted,
) -> None:
    """`tool_callbacks_must_match_the_executions_enabled_tools` — unknown name (`code-mode tool
    hidden is not enabled for this execution`), wrong namespace and wrong kind are rejected;
    namespace `functions` matches no namespace; the session stays open."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    execution_id = lease.executions[0].execution_id
    cases = [
        (tool_call(lease, execution_id, name="hidden"), texts.tool_not_enabled("hidden")),
        (tool_call(lease, execution_id, namespace="other"), texts.tool_not_enabled("echo")),
        (
            tool_call(lease, execution_id, kind=pb.TOOL_KIND_FREEFORM),
            texts.tool_not_enabled("echo"),
        ),
        (tool_call(lease, execution_id, namespace="functions"), None),
    ]
    for call, expected in cases:
        await lease.calls.put(call)
        wanted = call.invocation_id
        await eventually(partial(answered, lease, wanted))
        answer = next(c for c in lease.completions if c.invocation_id == call.invocation_id)
        if expected is None:
            assert answer.succeeded.output_json == b'{"echo":{"a":1}}'
        else:
            assert answer.failed.message == expected
    assert len(delegate.calls) == 1
    assert session.is_alive()


async def test_c17_execution_call_ids_must_be_bounded(scripted: Scripted) -> None:
    """`execution_call_ids_must_be_bounded` — a 257-byte `tool_call_id` fails with `gRPC
    code-mode host returned tool call ID exceeding 256 bytes`."""
    session, lease = await scripted.open(Delegate())
    scripted.fake.execute = starts_then()
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("x" * 257, ""))
    assert str(caught.value) == "gRPC code-mode host returned tool call ID exceeding 256 bytes"
    assert lease.executions == []


@pytest.mark.parametrize("variant", ["oversized", "foreign", "matching"])
async def test_c18_notification_call_ids_must_match_their_execution(
    scripted: Scripted, variant: str
) -> None:
    """`notification_call_ids_must_match_their_execution` — oversized call id → `gRPC code-mode
    host returned notification call ID exceeding 256 bytes`; another execution's call id →
    `code-mode notification call ID does not match its execution`; the matching one is
    admitted."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)
    scripted.fake.execute = starts_then("1")
    await session.execute(ExecuteRequest("mine", ""))
    scripted.fake.execute = starts_then("2")
    await session.execute(ExecuteRequest("theirs", ""))
    execution_id = lease.executions[0].execution_id
    call_id = {"oversized": "x" * 257, "foreign": "theirs", "matching": "mine"}[variant]
    await lease.events.put(notification(execution_id, call_id=call_id))
    if variant == "oversized":
        await fails_with(
            session, "gRPC code-mode host returned notification call ID exceeding 256 bytes"
        )
    elif variant == "foreign":
        await fails_with(session, "code-mode notification call ID does not match its execution")
    else:
        await eventually(lambda: lease.acks)
        assert delegate.notes == [("mine", "1", "t")]
        assert session.is_alive()


@pytest.mark.parametrize(
    "variant",
    ["invocation", "notification", "invocation cancel", "notification cancel", "remembered"],
)
async def test_c19_malformed_callback_ids_are_rejected_before_retention(
    scripted: Scripted, variant: str
) -> None:
    """`malformed_callback_ids_are_rejected_before_retention` — non-UUID invocation/notification
    ids (and cancellations of them) fail with the UUID errors; a remembered cancellation makes the
    later invocation cancelled."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    execution_id = lease.executions[0].execution_id
    if variant == "invocation":
        await lease.calls.put(tool_call(lease, execution_id, "not-a-uuid"))
        await fails_with(session, "code-mode tool invocation ID must be a UUID")
    elif variant == "notification":
        await lease.events.put(notification(execution_id, "not-a-uuid"))
        await fails_with(session, "code-mode notification ID must be a UUID")
    elif variant == "invocation cancel":
        await lease.events.put(tool_call_cancelled("not-a-uuid"))
        await fails_with(session, "code-mode tool invocation ID must be a UUID")
    elif variant == "notification cancel":
        await lease.events.put(
            pb.SessionEvent(
                notification_cancelled=pb.NotificationCancelled(notification_id="not-a-uuid")
            )
        )
        await fails_with(session, "code-mode notification ID must be a UUID")
    else:
        invocation = str(uuid.uuid4())
        await lease.events.put(tool_call_cancelled(invocation))
        await asyncio.sleep(0.1)
        await lease.calls.put(tool_call(lease, execution_id, invocation))
        await eventually(lambda: delegate.tokens)
        assert delegate.tokens[0].is_cancelled()
        await asyncio.sleep(0.1)
        assert lease.completions == []
        assert session.is_alive()
    binding = session._binding
    assert binding is not None
    assert binding._invocations == {} and binding._notifications == {}


async def test_c20_notifications_and_tools_share_the_pending_delegate_limit(
    scripted: Scripted,
) -> None:
    """`notifications_and_tools_share_the_pending_delegate_limit` — 1 024 notifications are
    admitted; the next notification and the next tool call are rejected with `code-mode host
    exceeded the limit of 1024 pending delegate calls`; finishing one frees a slot; the session
    stays open."""
    assert TOO_MANY_CALLBACKS == "code-mode host exceeded the limit of 1024 pending delegate calls"
    delegate = Delegate()
    session, lease = await scripted.open(delegate)
    releases: dict[str, asyncio.Event] = {}

    async def note(text: str, token: CancellationToken) -> None:
        await releases.setdefault(text, asyncio.Event()).wait()

    delegate.note = note
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    execution_id = lease.executions[0].execution_id
    for index in range(1024):
        event = notification(execution_id)
        event.notification.text = str(index)
        await lease.events.put(event)
    await eventually(lambda: len(delegate.notes) == 1024)
    extra = str(uuid.uuid4())
    await lease.events.put(notification(execution_id, extra))
    await eventually(lambda: lease.acks == [extra])
    assert len(delegate.notes) == 1024
    refused = str(uuid.uuid4())
    await lease.calls.put(tool_call(lease, execution_id, refused))
    await eventually(lambda: lease.completions)
    assert lease.completions[0].failed.message == TOO_MANY_CALLBACKS
    assert delegate.calls == []
    releases.setdefault("0", asyncio.Event()).set()
    await eventually(lambda: len(lease.acks) == 2)
    admitted = str(uuid.uuid4())
    await lease.calls.put(tool_call(lease, execution_id, admitted))
    await eventually(lambda: len(lease.completions) == 2)
    assert lease.completions[1].succeeded.output_json == b'{"echo":{"a":1}}'
    assert session.is_alive()
    for event_ in releases.values():
        event_.set()
    for index in range(1024):
        releases.setdefault(str(index), asyncio.Event()).set()


async def test_c21_terminated_cells_cancel_pending_notifications(scripted: Scripted) -> None:
    """`terminated_cells_cancel_pending_notifications` — cancelling a cell's notifications fires
    their cancellation."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)

    async def note(text: str, token: CancellationToken) -> None:
        await cancelled(token)

    delegate.note = note
    scripted.fake.execute = starts_then()
    await session.execute(ExecuteRequest("c", ""))
    execution_id = lease.executions[0].execution_id
    ids = [str(uuid.uuid4()) for _ in range(2)]
    for notification_id in ids:
        await lease.events.put(notification(execution_id, notification_id))
    await eventually(lambda: len(delegate.note_tokens) == 2)
    for notification_id in ids:
        await lease.events.put(
            pb.SessionEvent(
                notification_cancelled=pb.NotificationCancelled(notification_id=notification_id)
            )
        )
    await eventually(lambda: all(token.is_cancelled() for token in delegate.note_tokens))
    await eventually(lambda: sorted(lease.acks) == sorted(ids))
    assert session.is_alive()


async def test_c22_disconnect_revokes_callbacks_and_returns_each_live_cell_once(
    scripted: Scripted,
) -> None:
    """`disconnect_revokes_callbacks_and_returns_each_live_cell_once` — closing with reason
    `lease closed` returns each live cell once, cancels everything, and later operations fail
    with `lease closed`."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        await cancelled(token)
        return None

    async def note(text: str, token: CancellationToken) -> None:
        await cancelled(token)

    delegate.tool, delegate.note = tool, note
    for cell in ("1", "2"):
        scripted.fake.execute = starts_then(cell)
        KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    first = lease.executions[0].execution_id
    await lease.calls.put(tool_call(lease, first))
    await lease.events.put(notification(first))
    await eventually(lambda: delegate.tokens and delegate.note_tokens)
    await lease.events.put(None)  # the lease ends
    await fails_with(session, texts.LEASE_CLOSED_UNEXPECTEDLY)
    assert sorted(delegate.closed) == ["1", "2"]
    assert delegate.tokens[0].is_cancelled() and delegate.note_tokens[0].is_cancelled()
    binding = session._binding  # the lost gRPC session (the next execute would reconnect)
    assert binding is not None
    for operation in (
        binding.execute(ExecuteRequest("c", "")),
        binding.wait(WaitRequest(CellId("1"), 1)),
        session.terminate(CellId("2")),  # never reconnects: fails with the recorded reason
    ):
        with pytest.raises(ConnectionClosed) as caught:
            await operation
        assert str(caught.value) == texts.LEASE_CLOSED_UNEXPECTEDLY
    assert sorted(delegate.closed) == ["1", "2"]


# == §14.1 Completions, conversions, deadlines, callbacks ===========================================


def test_c23_completion_size_includes_the_protobuf_envelope() -> None:
    """`completion_size_includes_the_protobuf_envelope` — the size check counts the whole encoded
    request, not only the JSON."""
    session_id, invocation_id = str(uuid.uuid4()), str(uuid.uuid4())
    output = json.dumps("x" * 1000).encode()
    request = conversions.tool_call_succeeded(session_id, invocation_id, output)
    limit = len(output) + 10  # the JSON fits, the whole request does not
    assert request.ByteSize() > limit
    fitted = conversions.fit_message_limit(request, limit)
    assert fitted.invocation_id == invocation_id
    assert fitted.failed.message == texts.tool_result_too_large(request.ByteSize(), limit)


async def test_c24_delegate_errors_are_truncated_at_a_utf8_boundary(scripted: Scripted) -> None:
    """`delegate_errors_are_truncated_at_a_utf8_boundary` — a long failure message is cut on a
    character boundary and ends with `... [truncated]`."""
    delegate = Delegate()
    session, lease = await scripted.open(delegate)

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        raise CodeModeError("é" * 50_000)

    delegate.tool = tool
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    await lease.calls.put(tool_call(lease, lease.executions[0].execution_id))
    await eventually(lambda: lease.completions)
    message = lease.completions[0].failed.message
    assert message.endswith("... [truncated]")
    data = message.encode("utf-8")
    assert len(data) <= MAX_TOOL_ERROR_MESSAGE_BYTES
    assert set(message.removesuffix("... [truncated]")) == {"é"}
    assert session.is_alive()


def test_c25_completion_at_exact_message_limit_is_accepted() -> None:
    """`completion_at_exact_message_limit_is_accepted` — a request of exactly the limit is sent
    unchanged."""
    request = conversions.tool_call_succeeded(
        str(uuid.uuid4()), str(uuid.uuid4()), json.dumps("y" * 4000).encode()
    )
    assert conversions.fit_message_limit(request, request.ByteSize()) == request
    assert conversions.fit_message_limit(request, request.ByteSize() - 1).HasField("failed")


async def test_c26_execute_request_preserves_tool_schemas_namespaces_and_limits(
    scripted: Scripted,
) -> None:
    """`execute_request_preserves_tool_schemas_namespaces_and_limits` — schemas become JSON bytes,
    namespaces and limits survive."""
    tool = ToolDefinition(
        "ns__look",
        ToolName("look", "ns"),
        "looks",
        CodeModeToolKind.FREEFORM,
        {"type": "object", "properties": {"q": {"type": "string"}}},
        {"type": "string"},
    )
    session, lease = await scripted.open(Delegate())
    scripted.fake.execute = starts_then()
    await session.execute(ExecuteRequest("call", "text(1)", [tool], 1234, 99))
    sent = lease.executions[0]
    assert sent.tool_call_id == "call" and sent.source == "text(1)"
    assert sent.yield_time_ms == 1234 and sent.max_output_tokens == 99
    [wire] = sent.enabled_tools
    assert wire.name == "ns__look" and wire.description == "looks"
    assert wire.tool_name.name == "look" and wire.tool_name.namespace == "ns"
    assert wire.kind == pb.TOOL_KIND_FREEFORM
    assert json.loads(wire.input_schema_json) == tool.input_schema
    assert json.loads(wire.output_schema_json) == tool.output_schema
    limits = conversions.open_session_request(
        CodeModeSessionCellExecutionLimits(max_yield_time_ms=7, max_heap_size_bytes=1 << 24)
    )
    assert conversions.limits_to_domain(
        limits.cell_execution_limits
    ) == CodeModeSessionCellExecutionLimits(7, 1 << 24)


async def test_c27_runtime_response_decodes_mixed_content_items(scripted: Scripted) -> None:
    """`runtime_response_decodes_mixed_content_items` — text, image (each detail) and audio items
    decode in order."""
    items = [pb.ContentItem(text=pb.TextContent(text="hello"))]
    expected: list[Any] = [InputText("hello")]
    items.append(pb.ContentItem(image=pb.ImageContent(image_url="data:plain")))
    expected.append(InputImage("data:plain"))
    for detail in ImageDetail:
        item = conversions.content_item_to_proto(InputImage(f"data:{detail}", detail))
        items.append(item)
        expected.append(InputImage(f"data:{detail}", detail))
    items.append(pb.ContentItem(audio=pb.AudioContent(audio_url="data:audio")))
    expected.append(InputAudio("data:audio"))
    session, _ = await scripted.open(Delegate())

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield started_event(request)
        yield pb.ExecuteEvent(outcome=outcome("1", items=items))

    scripted.fake.execute = script
    started = await session.execute(ExecuteRequest("c", ""))
    assert await started.initial_response() == Result(CellId("1"), expected)


async def test_c28_wait_outcome_preserves_missing_cell_state(scripted: Scripted) -> None:
    """`wait_outcome_preserves_missing_cell_state` — `missing_cell` stays a missing-cell
    outcome."""
    session, _ = await scripted.open(Delegate())
    text = pb.ContentItem(text=pb.TextContent(text="exec cell 9 not found"))

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        result = outcome(request.cell_id, items=[text])
        result.completed.error_text = "exec cell 9 not found"
        return pb.WaitResponse(missing_cell=result)

    scripted.fake.wait = wait
    got = await session.wait(WaitRequest(CellId("9"), 1))
    assert got == MissingCell(
        Result(CellId("9"), [InputText("exec cell 9 not found")], "exec cell 9 not found")
    )


async def test_c29_oversized_response_cell_ids_are_rejected(scripted: Scripted) -> None:
    """`oversized_response_cell_ids_are_rejected` — cell ids over 256 bytes in outcomes are
    refused."""
    long = "x" * 257
    text = "gRPC code-mode host returned cell ID exceeding 256 bytes"
    session, _ = await scripted.open(Delegate())

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        return pb.WaitResponse(live_cell=outcome(long, "yielded"))

    scripted.fake.wait = wait
    with pytest.raises(CodeModeError) as caught:
        await session.wait(WaitRequest(CellId("1"), 1))
    assert str(caught.value) == text
    session, _ = await scripted.open(Delegate())

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        yield started_event(request)
        yield pb.ExecuteEvent(outcome=outcome(long))

    scripted.fake.execute = script
    started = await session.execute(ExecuteRequest("c", ""))
    with pytest.raises(CodeModeError) as caught:
        await started.initial_response()
    assert str(caught.value) == text


async def test_c30_invalid_output_enums_and_missing_oneofs_are_rejected(
    scripted: Scripted,
) -> None:
    """`invalid_output_enums_and_missing_oneofs_are_rejected` — bad image detail, missing
    outcome/content oneofs fail with the §10 texts."""
    session, _ = await scripted.open(Delegate())
    bad_detail = pb.ContentItem(image=pb.ImageContent(image_url="u"))
    bad_detail.image.detail = 99  # type: ignore[assignment]
    unspecified = pb.ContentItem(image=pb.ImageContent(image_url="u"))
    unspecified.image.detail = 0  # type: ignore[assignment]
    cases: list[tuple[pb.WaitResponse, str]] = [
        (
            pb.WaitResponse(live_cell=outcome("1", items=[bad_detail])),
            "code-mode image has invalid detail value 99",
        ),
        (
            pb.WaitResponse(live_cell=outcome("1", items=[unspecified])),
            "code-mode image has invalid detail value 0",
        ),
        (
            pb.WaitResponse(live_cell=outcome("1", items=[pb.ContentItem()])),
            "code-mode execution returned an empty content item",
        ),
        (
            pb.WaitResponse(live_cell=pb.ExecutionOutcome(cell_id="1")),
            "code-mode execution omitted its outcome",
        ),
        (pb.WaitResponse(), "code-mode wait omitted its outcome"),
    ]
    for response, text in cases:

        async def wait(request: Any, context: Any, response: Any = response) -> pb.WaitResponse:
            return response  # type: ignore[no-any-return]

        scripted.fake.wait = wait
        with pytest.raises(CodeModeError) as caught:
            await session.wait(WaitRequest(CellId("1"), 1))
        assert str(caught.value) == text
    assert session.is_alive()


def stall() -> Callable[[Any, Any], Awaitable[pb.WaitResponse]]:
    async def hang(request: Any, context: Any) -> pb.WaitResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    return hang


async def test_c31_stalled_transport_fails_after_its_deadline(scripted: Scripted) -> None:
    """`stalled_transport_fails_after_its_deadline` — a call with no runtime allowance times out
    at 60 s (not before). (The 60 s allowance is scaled down to 0.6 s here.)"""
    assert scripted.provider.response_timeout == 60.0
    scripted.respond_within(0.6)
    session, _ = await scripted.open(Delegate())
    scripted.fake.terminate = stall()
    began = time.monotonic()
    terminating = asyncio.create_task(session.terminate(CellId("1")))
    await asyncio.sleep(0.45)
    assert not terminating.done()
    with pytest.raises(ConnectionClosed) as caught:
        await terminating
    assert 0.55 <= time.monotonic() - began < 2.0
    assert str(caught.value) == "gRPC code-mode host timed out waiting for termination response"


async def test_c32_requested_runtime_duration_is_added_to_the_transport_deadline(
    scripted: Scripted,
) -> None:
    """`requested_runtime_duration_is_added_to_the_transport_deadline` — a wait of Y ms times out
    at Y + 1 s + 60 s. (60 s is scaled down to 0.3 s; Y = 300.)"""
    scripted.respond_within(0.3)
    session, _ = await scripted.open(Delegate())
    scripted.fake.wait = stall()
    began = time.monotonic()
    waiting = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 300)))
    await asyncio.sleep(1.45)
    assert not waiting.done()
    with pytest.raises(ConnectionClosed) as caught:
        await waiting
    assert 1.55 <= time.monotonic() - began < 2.5
    assert str(caught.value) == "gRPC code-mode host timed out waiting for wait response"


async def test_c33_default_execution_yield_and_grace_extend_the_outcome_deadline(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`default_execution_yield_and_grace_extend_the_outcome_deadline` — a default execute
    outcome is still pending at 70 s and timed out at 72 s. (Scaled: default yield 0.2 s,
    transport allowance 0.3 s: pending at 1.4 s, timed out by 1.6 s.)"""
    assert client_grpc.DEFAULT_YIELD_TIME_MS == 10_000
    scripted.respond_within(0.3)
    monkeypatch.setattr(client_grpc, "DEFAULT_YIELD_TIME_MS", 200)
    session, _ = await scripted.open(Delegate())
    scripted.fake.execute = starts_then()
    started = await session.execute(ExecuteRequest("c", ""))
    began = time.monotonic()
    initial = asyncio.create_task(started.initial_response())
    await asyncio.sleep(1.4)
    assert not initial.done()
    with pytest.raises(ConnectionClosed) as caught:
        await initial
    assert time.monotonic() - began < 1.8
    assert str(caught.value) == "gRPC code-mode host timed out waiting for execution response"


async def test_c34_transport_status_is_preserved(scripted: Scripted) -> None:
    """`transport_status_is_preserved` — the status code and message appear in the error."""
    session, _ = await scripted.open(Delegate())

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        await context.abort(StatusCode.INVALID_ARGUMENT, "bad wait request")
        raise AssertionError("unreachable")

    scripted.fake.wait = wait
    with pytest.raises(CodeModeError) as caught:
        await session.wait(WaitRequest(CellId("1"), 1))
    assert str(caught.value) == "gRPC code-mode wait failed: INVALID_ARGUMENT: bad wait request"
    assert session.is_alive()


async def test_c35_transport_status_messages_are_bounded_at_utf8_boundaries(
    scripted: Scripted,
) -> None:
    """`transport_status_messages_are_bounded_at_utf8_boundaries` — error texts are ≤ 512 bytes,
    cut on a character boundary, ending `...`."""
    session, _ = await scripted.open(Delegate())

    async def wait(request: Any, context: Any) -> pb.WaitResponse:
        await context.abort(
            StatusCode.INVALID_ARGUMENT, "é" * 600
        )  # 1 200 bytes (gRPC caps metadata at 8 KiB)
        raise AssertionError("unreachable")

    scripted.fake.wait = wait
    with pytest.raises(CodeModeError) as caught:
        await session.wait(WaitRequest(CellId("1"), 1))
    message = str(caught.value)
    assert len(message.encode("utf-8")) <= 512
    assert message.endswith("...")
    prefix = "gRPC code-mode wait failed: INVALID_ARGUMENT: "
    assert message.startswith(prefix)
    assert set(message.removeprefix(prefix).removesuffix("...")) == {"é"}


async def test_c36_stalled_channel_acquisition_times_out_and_remains_retryable(
    scripted: Scripted,
) -> None:
    """`stalled_channel_acquisition_times_out_and_remains_retryable` — a stuck connection
    attempt times out and a later attempt can still succeed."""
    scripted.fake.open_hangs = 1
    provider = GrpcCodeModeSessionProvider(f"grpc://127.0.0.1:{scripted.port}", open_timeout=0.5)
    try:
        began = time.monotonic()
        with pytest.raises(CodeModeError) as caught:
            await provider.create_session(Delegate())
        assert time.monotonic() - began < 3
        assert str(caught.value) == (
            "gRPC code-mode host timed out waiting for session opening response"
        )
        session = await provider.create_session(Delegate())
        assert session.is_alive()
    finally:
        await provider.aclose()


async def test_c37_missing_invocation_completion_racing_cancellation_preserves_session(
    scripted: Scripted,
) -> None:
    """`missing_invocation_completion_racing_cancellation_preserves_session` — `NOT_FOUND` on a
    completion whose invocation was cancelled meanwhile leaves the session open."""
    session, lease = await scripted.open(Delegate())

    async def complete(request: Any, context: Any) -> None:
        await lease.events.put(tool_call_cancelled(request.invocation_id))
        await asyncio.sleep(0.2)
        await context.abort(StatusCode.NOT_FOUND, texts.unknown_invocation(request.invocation_id))

    scripted.fake.complete = complete
    scripted.fake.execute = starts_then()
    KEPT.append(await session.execute(ExecuteRequest("c", "", [ECHO])))
    await lease.calls.put(tool_call(lease, lease.executions[0].execution_id))
    await eventually(lambda: lease.completions)
    await asyncio.sleep(0.5)
    assert session.is_alive(), session.failure


# == §14.2 End-to-end cases ==========================================================================


def test_e01_grpc_endpoints_reject_credentials_without_disclosing_them() -> None:
    """`grpc_endpoints_reject_credentials_without_disclosing_them` — `http://alice:secret@…`,
    `https://alice@…`, `https://:secret@…` fail with `must not include credentials` and never
    show `alice`/`secret`."""
    for target in (
        "http://alice:secret@127.0.0.1:5",
        "https://alice@127.0.0.1:5",
        "https://:secret@127.0.0.1:5",
    ):
        for attempt in (parse_endpoint, GrpcCodeModeSessionProvider):
            with pytest.raises(CodeModeError) as caught:
                attempt(target)
            message = str(caught.value)
            assert "must not include credentials" in message
            assert "alice" not in message and "secret" not in message


async def test_e02_tcp_session_persists_values_and_forwards_tools_notifications_and_closure(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`tcp_session_persists_values_and_forwards_tools_notifications_and_closure` — cell 1 stores,
    cell 2 loads and calls `echo` (delegate sees cell `2`, `tool-1`, input `{"value":"persisted"}`)
    and notifies (`call-2`, `2`, `notice`); shutdown reports cells `1` and `2` closed to their own
    delegates."""
    delegate = Delegate()
    session = await client.create_session(delegate)
    first = await session.execute(ExecuteRequest("call-1", 'store("v", "persisted")'))
    assert await first.initial_response() == Result(CellId("1"), [])
    second = await session.execute(
        ExecuteRequest(
            "call-2",
            'await tools.echo({value: load("v")}); notify("notice"); text("ok")',
            [ECHO],
        )
    )
    assert second.cell_id == CellId("2")
    assert await second.initial_response() == Result(CellId("2"), [InputText("ok")])
    [call] = delegate.calls
    assert call.cell_id == CellId("2") and call.runtime_tool_call_id == "tool-1"
    assert call.input == {"value": "persisted"}
    assert delegate.notes == [("call-2", "2", "notice")]
    await session.shutdown()
    assert sorted(delegate.closed) == ["1", "2"]


async def test_e03_grpc_early_yield_preserves_cell_and_later_waits(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`grpc_early_yield_preserves_cell_and_later_waits` — an execute with an already-raised
    early-yield signal returns `Yielded` while its tool call is still running; a wait yields
    early when signalled; a later wait returns the completion `["done"]`."""
    delegate = Delegate()
    release = asyncio.Event()

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        await release.wait()
        return "ok"

    delegate.tool = tool
    session = await client.create_session(delegate)
    signal = asyncio.Event()
    signal.set()
    started = await session.execute(
        ExecuteRequest("c", 'await tools.echo({}); text("done")', [ECHO], 60_000),
        early_yield=signal,
    )
    assert await asyncio.wait_for(started.initial_response(), 10) == Yielded(started.cell_id, [])
    await eventually(lambda: delegate.calls)  # the tool call is still running
    signal = asyncio.Event()
    waiting = asyncio.create_task(
        session.wait(WaitRequest(started.cell_id, 60_000), early_yield=signal)
    )
    await asyncio.sleep(0.2)
    assert not waiting.done()
    signal.set()
    assert await asyncio.wait_for(waiting, 10) == LiveCell(Yielded(started.cell_id, []))
    release.set()
    assert await session.wait(WaitRequest(started.cell_id, 60_000)) == LiveCell(
        Result(started.cell_id, [InputText("done")])
    )


async def test_e04_shutdown_immediately_rejects_new_operations(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`shutdown_immediately_rejects_new_operations` — after `shutdown()` starts, execute, wait
    and terminate fail with `code mode session is shutting down`."""
    session = await client.create_session(Delegate())
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=1))
    await started.initial_response()
    shutting = asyncio.create_task(session.shutdown())
    await asyncio.sleep(0)  # shutdown() has started: its body ran
    assert not session.is_alive()
    for operation in (
        session.execute(ExecuteRequest("c", "text(1)")),
        session.wait(WaitRequest(started.cell_id, 1)),
        session.terminate(started.cell_id),
    ):
        with pytest.raises(CodeModeError) as caught:
            await operation
        assert str(caught.value) == SESSION_SHUTTING_DOWN == "code mode session is shutting down"
    await shutting


async def test_e05_cancelling_execution_before_admission_keeps_the_session_usable(
    client: GrpcCodeModeSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cancelling_execution_before_admission_keeps_the_session_usable` — an execute dropped
    before admission still gets its cell terminated and reported closed; the next cell (`2`)
    runs."""
    delegate = Delegate()
    session = await client.create_session(delegate)
    binding = session._binding
    assert binding is not None
    original = binding._started

    async def slow_started(record: Any, call: Any) -> str:
        await asyncio.sleep(0.5)  # the host admits the cell; the caller gives up before reading
        return await original(record, call)

    monkeypatch.setattr(binding, "_started", slow_started)
    executing = asyncio.create_task(session.execute(ExecuteRequest("c", FOREVER)))
    await asyncio.sleep(0.25)
    executing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await executing
    monkeypatch.setattr(binding, "_started", original)
    await eventually(lambda: delegate.closed == ["1"])
    started = await session.execute(ExecuteRequest("c", "text(2)"))
    assert started.cell_id == CellId("2")
    assert await started.initial_response() == Result(CellId("2"), [InputText("2")])


async def test_e06_dropping_a_started_cell_off_runtime_terminates_its_buffered_remote_execution(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`dropping_a_started_cell_off_runtime_terminates_its_buffered_remote_execution` — dropping a
    started cell whose initial response is buffered terminates it remotely and reports it
    closed."""
    delegate = Delegate()
    session = await client.create_session(delegate)
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=1))
    await asyncio.sleep(0.3)  # the Yielded initial response is buffered, unread
    del started
    gc.collect()
    await eventually(lambda: delegate.closed == ["1"])
    assert session.is_alive()


async def test_e07_dropping_an_initial_response_terminates_its_pending_remote_execution(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`dropping_an_initial_response_terminates_its_pending_remote_execution` — aborting the
    initial-response wait terminates the cell and reports it closed; the session stays usable."""
    delegate = Delegate()
    session = await client.create_session(delegate)
    started = await session.execute(ExecuteRequest("c", FOREVER))
    waiting = asyncio.create_task(started.initial_response())
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await eventually(lambda: delegate.closed == ["1"])
    again = await session.execute(ExecuteRequest("c", "text(2)"))
    assert await again.initial_response() == Result(CellId("2"), [InputText("2")])


async def test_e08_synchronous_delegate_panics_do_not_orphan_callbacks_or_close_the_session(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`synchronous_delegate_panics_do_not_orphan_callbacks_or_close_the_session` — a raising tool
    delegate makes the JS call reject (caught by the cell); a raising notify delegate does not
    affect the cell; later cells run."""
    delegate = Delegate()

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        raise RuntimeError("tool panic")

    async def note(text: str, token: CancellationToken) -> None:
        raise RuntimeError("notify panic")

    delegate.tool, delegate.note = tool, note
    session = await client.create_session(delegate)
    started = await session.execute(
        ExecuteRequest(
            "c",
            'try { await tools.echo({}) } catch (e) { text("caught") } notify("n"); text("after")',
            [ECHO],
        )
    )
    assert await started.initial_response() == Result(
        CellId("1"), [InputText("caught"), InputText("after")]
    )
    later = await session.execute(ExecuteRequest("c", "text(2)"))
    assert await later.initial_response() == Result(CellId("2"), [InputText("2")])
    assert session.is_alive()


async def test_e09_tool_delegate_self_cancellation_returns_an_error_without_hanging(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`tool_delegate_self_cancellation_returns_an_error_without_hanging` — a delegate that
    cancels its own token and fails yields a catchable rejection; nothing hangs."""
    delegate = Delegate()

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        token.cancel()
        raise RuntimeError("gave up")

    delegate.tool = tool
    session = await client.create_session(delegate)
    started = await session.execute(
        ExecuteRequest("c", 'try { await tools.echo({}) } catch (e) { text("rejected") }', [ECHO])
    )
    response = await asyncio.wait_for(started.initial_response(), 10)
    assert response == Result(CellId("1"), [InputText("rejected")])


async def test_e10_concurrent_wait_rejects_without_displacing_the_active_observer(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`concurrent_wait_rejects_without_displacing_the_active_observer` — a second wait fails
    within 1 s with `exec cell ⟨id⟩ already has an active observer`; the first returns `Yielded`;
    terminate returns `Terminated`."""
    session = await client.create_session(Delegate())
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=1))
    await started.initial_response()
    first = asyncio.create_task(session.wait(WaitRequest(started.cell_id, 1500)))
    await asyncio.sleep(0.2)
    began = time.monotonic()
    with pytest.raises(CodeModeError) as caught:
        await session.wait(WaitRequest(started.cell_id, 10_000))
    assert time.monotonic() - began < 1
    assert str(caught.value) == f"exec cell {started.cell_id} already has an active observer"
    assert await first == LiveCell(Yielded(started.cell_id, []))
    assert await session.terminate(started.cell_id) == LiveCell(Terminated(started.cell_id, []))


async def test_e11_dropping_a_wait_retires_its_observer_before_the_next_wait(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`dropping_a_wait_retires_its_observer_before_the_next_wait` — after aborting a wait, the
    next wait on the same cell succeeds (`Yielded`), proving the old observer retired first."""
    session = await client.create_session(Delegate())
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=1))
    await started.initial_response()
    waiting = asyncio.create_task(session.wait(WaitRequest(started.cell_id, 60_000)))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    outcome_ = await session.wait(WaitRequest(started.cell_id, 10))
    assert outcome_ == LiveCell(Yielded(started.cell_id, []))


async def test_e12_dropping_a_session_off_runtime_retires_its_active_cells(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`dropping_a_session_off_runtime_retires_its_active_cells` — dropping the session object
    closes its running cell (reported closed)."""
    delegate = Delegate()
    session = await client.create_session(delegate)
    started = await session.execute(ExecuteRequest("c", FOREVER, yield_time_ms=1))
    await started.initial_response()
    del session, started
    gc.collect()
    await eventually(lambda: delegate.closed == ["1"], timeout=3)


@pytest.mark.timeout(60)
async def test_e13_large_unary_tool_completion_does_not_block_an_independent_session(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`large_unary_tool_completion_does_not_block_an_independent_session` — while an 8 MiB tool
    result is pending in one session, another session runs cells; the large result then arrives
    intact (`8388608`)."""
    release = asyncio.Event()
    big = Delegate()

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        await release.wait()
        return "x" * 8_388_608

    big.tool = tool
    large = await client.create_session(big)
    other = await client.create_session(Delegate())
    started = await large.execute(
        ExecuteRequest("c", "text(String((await tools.echo({})).length))", [ECHO])
    )
    await eventually(lambda: big.calls)
    for index in range(3):
        cell = await other.execute(ExecuteRequest("c", f"text({index})"))
        assert await cell.initial_response() == Result(cell.cell_id, [InputText(str(index))])
    release.set()
    assert await started.initial_response() == Result(CellId("1"), [InputText("8388608")])


async def test_e14_single_subscription_processes_slow_and_fast_tools_concurrently(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`single_subscription_processes_slow_and_fast_tools_concurrently` — one subscription serves
    a slow and a fast tool call concurrently."""
    delegate = Delegate()
    fast_done = asyncio.Event()

    async def tool(call: CodeModeNestedToolCall, token: CancellationToken) -> JSON:
        if call.tool_name.name == "slow":
            await asyncio.wait_for(fast_done.wait(), 5)  # only finishes if fast ran meanwhile
            return "slow"
        fast_done.set()
        return "fast"

    delegate.tool = tool
    session = await client.create_session(delegate)
    tools = [ToolDefinition(name, ToolName(name), name) for name in ("slow", "fast")]
    started = await session.execute(
        ExecuteRequest(
            "c", "text((await Promise.all([tools.slow({}), tools.fast({})])).join())", tools
        )
    )
    assert await started.initial_response() == Result(CellId("1"), [InputText("slow,fast")])


async def test_e15_sessions_enforce_independent_yield_limits(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`sessions_enforce_independent_yield_limits` — a session with `max_yield_time_ms = 1` and a
    16 MiB heap limit yields a 60 s execute and a 60 s wait at once; another session with a
    1 000 ms limit still completes a 25 ms timer cell."""
    tight = await client.create_session_with_limits(
        Delegate(), CodeModeSessionCellExecutionLimits(1, 16 * 1024 * 1024)
    )
    loose = await client.create_session_with_limits(
        Delegate(), CodeModeSessionCellExecutionLimits(1000)
    )
    began = time.monotonic()
    started = await tight.execute(ExecuteRequest("c", FOREVER, yield_time_ms=60_000))
    assert isinstance(await started.initial_response(), Yielded)
    waited = await tight.wait(WaitRequest(started.cell_id, 60_000))
    assert waited == LiveCell(Yielded(started.cell_id, []))
    assert time.monotonic() - began < 5
    timer = await loose.execute(
        ExecuteRequest("c", 'await new Promise(r => setTimeout(r, 25)); text("ok")')
    )
    assert await timer.initial_response() == Result(CellId("1"), [InputText("ok")])


async def test_e16_dropping_a_grpc_lease_retires_its_server_session(host: GrpcHost) -> None:
    """`dropping_a_grpc_lease_retires_its_server_session` — after the raw lease stream is
    dropped, `SubscribeToToolCalls` for that session returns `NOT_FOUND`."""
    async with aio.insecure_channel(host.url.removeprefix("grpc://")) as channel:
        stub = v1_pb2_grpc.CodeModeHostStub(channel)
        lease = stub.OpenSession(pb.OpenSessionRequest())
        first: Any = await lease.read()
        session_id = first.opened.session_id
        lease.cancel()
        deadline = time.monotonic() + 1.0
        while True:
            subscription = stub.SubscribeToToolCalls(
                pb.SubscribeToToolCallsRequest(session_id=session_id)
            )
            try:
                await asyncio.wait_for(subscription.read(), 0.2)
            except aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    break
            except TimeoutError:
                subscription.cancel()
            assert time.monotonic() < deadline, "the session outlived its lease"
            await asyncio.sleep(0.05)


async def test_e17_cached_session_recovers_after_a_remote_host_restarts() -> None:
    """`cached_session_recovers_after_a_remote_host_restarts` — killing the host fails the pending
    wait and reports the old cell closed; terminate of the old cell fails; the next two concurrent
    executes, a queued execute and a queued wait all fail with the exact replacement message; then
    cells run as `g2:1`, `g2:2`, `g2:3` with empty stored values; old ids fail with `stale
    code-mode host generation`."""
    async with LocalSessionProvider() as local:
        first = GrpcHost(local, "grpc://127.0.0.1:0")
        await first.start()
        port = int(first.url.rsplit(":", 1)[1])
        provider = GrpcCodeModeSessionProvider(first.url)
        delegate = Delegate()
        session = await provider.create_session(delegate)
        started = await session.execute(ExecuteRequest("c", 'store("k", 1); ' + FOREVER, [], 1))
        await started.initial_response()
        waiting = asyncio.create_task(session.wait(WaitRequest(started.cell_id, 60_000)))
        await asyncio.sleep(0.2)
        await first.aclose()
        with pytest.raises(CodeModeError):
            await waiting
        await eventually(lambda: delegate.closed == ["1"])
        with pytest.raises(CodeModeError):
            await session.terminate(started.cell_id)
        second = GrpcHost(local, f"grpc://127.0.0.1:{port}")
        await second.start()
        try:
            # Created before the reconnect: two concurrent executes, a queued one, a queued wait.
            before = [
                session.execute(ExecuteRequest("c", "text(1)")),
                session.execute(ExecuteRequest("c", "text(2)")),
                session.execute(ExecuteRequest("c", "text(3)")),
                session.wait(WaitRequest(started.cell_id, 1)),
            ]
            for failed in await asyncio.gather(*before, return_exceptions=True):
                assert isinstance(failed, CodeModeError)
                assert str(failed) == texts.RUNTIME_REPLACED
            assert texts.RUNTIME_REPLACED.startswith("The exec runtime was replaced. Stored values")
            cells = [
                await session.execute(ExecuteRequest("c", 'text(String(load("k")))'))
                for _ in range(3)
            ]
            assert [cell.cell_id for cell in cells] == [CellId(f"g2:{n}") for n in (1, 2, 3)]
            for cell in cells:
                assert await cell.initial_response() == Result(
                    cell.cell_id, [InputText("undefined")]
                )
            for old in (started.cell_id, CellId("g1:1"), CellId("g3:1")):
                with pytest.raises(CodeModeError) as caught:
                    await session.wait(WaitRequest(old, 1))
                assert str(caught.value) == "cell belongs to a stale code-mode host generation"
            assert session.generation == 2
        finally:
            await provider.aclose()
            await second.aclose()


async def test_e18_unix_socket_endpoints_execute_code_mode_cells() -> None:
    """`unix_socket_endpoints_execute_code_mode_cells` — `unix:///path` and `unix:/path` endpoints
    work. (The host listens on TCP only, so a scripted host serves the socket.)"""
    fake = Fake()
    server = aio.server()
    v1_pb2_grpc.add_CodeModeHostServicer_to_server(fake, server)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "host.sock")
        server.add_insecure_port(f"unix:{path}")
        await server.start()

        async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
            yield started_event(request)
            yield pb.ExecuteEvent(
                outcome=outcome("1", items=[pb.ContentItem(text=pb.TextContent(text="unix"))])
            )

        fake.execute = script
        try:
            for target in (f"unix://{path}", f"unix:{path}"):
                async with GrpcCodeModeSessionProvider(target) as provider:
                    session = await provider.create_session(Delegate())
                    started = await session.execute(ExecuteRequest("c", "text('unix')"))
                    assert await started.initial_response() == Result(
                        CellId("1"), [InputText("unix")]
                    )
        finally:
            await server.stop(0)


@pytest.mark.timeout(30)
async def test_e19_session_admission_retries_only_transient_failures_and_is_bounded(
    scripted: Scripted,
) -> None:
    """`session_admission_retries_only_transient_failures_and_is_bounded` — one `UNAVAILABLE` or
    `RESOURCE_EXHAUSTED` → 2 attempts and success; endless `UNAVAILABLE` → 5 attempts and failure;
    `INVALID_ARGUMENT` or `UNKNOWN` → 1 attempt and failure."""
    fake = scripted.fake
    for code in (StatusCode.UNAVAILABLE, StatusCode.RESOURCE_EXHAUSTED):
        fake.open_attempts, fake.open_failures = 0, [(code, "busy")]
        session = await scripted.provider.create_session(Delegate())
        assert session.is_alive() and fake.open_attempts == 2
    fake.open_attempts, fake.open_failures = 0, [(StatusCode.UNAVAILABLE, "down")] * 10
    with pytest.raises(CodeModeError) as caught:
        await scripted.provider.create_session(Delegate())
    assert fake.open_attempts == 5
    assert str(caught.value) == "gRPC code-mode session opening failed: UNAVAILABLE: down"
    for code in (StatusCode.INVALID_ARGUMENT, StatusCode.UNKNOWN):
        fake.open_attempts, fake.open_failures = 0, [(code, "no")]
        with pytest.raises(CodeModeError) as caught:
            await scripted.provider.create_session(Delegate())
        assert fake.open_attempts == 1
        assert str(caught.value) == f"gRPC code-mode session opening failed: {code.name}: no"


async def test_e20_session_admission_recovers_after_connection_reset(host: GrpcHost) -> None:
    """`session_admission_recovers_after_connection_reset` — a connection reset on the first
    attempt is retried and the session works. (A TCP proxy resets the first connection.)"""
    target_port = int(host.url.rsplit(":", 1)[1])
    connections = 0
    pumps: set[asyncio.Task[None]] = set()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            writer.transport.abort()  # a reset
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        for task in (pump(reader, up_writer), pump(up_reader, writer)):
            pumps.add(asyncio.create_task(task))

    proxy = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    try:
        async with GrpcCodeModeSessionProvider(f"grpc://127.0.0.1:{port}") as provider:
            session = await provider.create_session(Delegate())
            started = await session.execute(ExecuteRequest("c", "text(1)"))
            assert await started.initial_response() == Result(CellId("1"), [InputText("1")])
        assert connections >= 2
    finally:
        proxy.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def test_e21_routing_metadata_is_scoped_to_each_session_on_a_shared_provider(
    scripted: Scripted,
) -> None:
    """`routing_metadata_is_scoped_to_each_session_on_a_shared_provider` — `OpenSession` carries no
    route; each session replays only its own route on every RPC; a rejected admission's route is
    ignored; an `UNAVAILABLE` execute is not replayed and does not reopen; with
    `x-code-mode-route-lost: true` the next execute reports the replacement, then the session
    reopens (stored value gone) while the other session keeps its state."""
    fake = scripted.fake
    routes: dict[str, list[str | None]] = {}
    fake.routed = True
    open_routes = fake.open_routes
    attempts = 0

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        nonlocal attempts
        attempts += 1
        metadata = dict(context.invocation_metadata())
        routes.setdefault(request.session_id, []).append(metadata.get("x-code-mode-route"))
        if attempts == 3:
            await context.send_initial_metadata((("x-code-mode-route-lost", "true"),))
            await context.abort(StatusCode.UNAVAILABLE, "route lost")
        yield started_event(request, str(attempts))
        yield pb.ExecuteEvent(outcome=outcome(str(attempts)))

    fake.execute = script
    one = await scripted.provider.create_session(Delegate())
    two = await scripted.provider.create_session(Delegate())
    assert open_routes == [None, None]
    await (await one.execute(ExecuteRequest("c", ""))).initial_response()
    await (await two.execute(ExecuteRequest("c", ""))).initial_response()
    assert routes[one.session_id] == ["r1"] and routes[two.session_id] == ["r2"]
    with pytest.raises(CodeModeError):
        await one.execute(ExecuteRequest("c", ""))
    with pytest.raises(CodeModeError) as caught:  # the replacement is reported
        await one.execute(ExecuteRequest("c", ""))
    assert "replac" in str(caught.value)
    again = await one.execute(ExecuteRequest("c", ""))
    assert again.cell_id == CellId("g2:4")
    assert len(open_routes) == 3


async def test_e22_only_missing_sessions_reopen_without_replaying_execution(
    scripted: Scripted,
) -> None:
    """`only_missing_sessions_reopen_without_replaying_execution` — `NOT_FOUND` on Execute: the
    call fails with `gRPC code-mode execution failed: ⟨status⟩`, the next execute reports the
    replacement, the one after runs as `g2:1` with empty store; `INVALID_ARGUMENT`,
    `UNAVAILABLE`, and `UNAVAILABLE` + route-lost on an unrouted session fail the call only and
    the next cell is `2` with the store intact."""
    session, _ = await scripted.open(Delegate())
    calls = 0

    async def script(request: Any, context: Any) -> AsyncIterator[pb.ExecuteEvent]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await context.abort(StatusCode.NOT_FOUND, "unknown code-mode session")
        yield started_event(request, "1")
        yield pb.ExecuteEvent(outcome=outcome("1"))

    scripted.fake.execute = script
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value) == (
        "gRPC code-mode execution failed: NOT_FOUND: unknown code-mode session"
    )
    with pytest.raises(CodeModeError) as caught:
        await session.execute(ExecuteRequest("c", ""))
    assert str(caught.value) == texts.RUNTIME_REPLACED
    started = await session.execute(ExecuteRequest("c", ""))
    assert started.cell_id == CellId("g2:1")
    # Other statuses fail the call only: the binding stays, nothing is replayed or reopened.
    for cell, code, route_lost in (
        ("2", StatusCode.INVALID_ARGUMENT, False),
        ("3", StatusCode.UNAVAILABLE, False),
        ("4", StatusCode.UNAVAILABLE, True),  # the marker means nothing on an unrouted session
    ):
        leases, attempts = len(scripted.fake.leases), 0

        async def failing(
            request: Any,
            context: Any,
            cell: str = cell,
            code: StatusCode = code,
            route_lost: bool = route_lost,
        ) -> AsyncIterator[pb.ExecuteEvent]:
            nonlocal attempts
            attempts += 1
            if attempts == 1:
                if route_lost:
                    await context.send_initial_metadata((("x-code-mode-route-lost", "true"),))
                await context.abort(code, "nope")
            yield started_event(request, cell)
            yield pb.ExecuteEvent(outcome=outcome(cell))

        scripted.fake.execute = failing
        with pytest.raises(CodeModeError) as caught:
            await session.execute(ExecuteRequest("c", ""))
        assert str(caught.value) == f"gRPC code-mode execution failed: {code.name}: nope"
        started = await session.execute(ExecuteRequest("c", ""))
        assert started.cell_id == CellId(f"g2:{cell}") and session.generation == 2
        assert attempts == 2 and len(scripted.fake.leases) == leases


async def test_e23_cancellation_stops_reentrant_image_getter(
    client: GrpcCodeModeSessionProvider,
) -> None:
    """`cancellation_stops_reentrant_image_getter` — terminate interrupts a cell stuck in a
    re-entrant `image_url` getter within 1 s (both terminate and the initial response report
    `Terminated`), while another session keeps its stored values."""
    other = await client.create_session(Delegate())
    stored = await other.execute(ExecuteRequest("c", 'store("kept", 7)'))
    await stored.initial_response()
    session = await client.create_session(Delegate())
    started = await session.execute(
        ExecuteRequest(
            "c",
            "image({get image_url() { image({get image_url() { for (;;) {} }}); return 'x'; }})",
        )
    )
    initial = asyncio.create_task(started.initial_response())
    await asyncio.sleep(0.3)
    began = time.monotonic()
    terminated = await session.terminate(started.cell_id)
    assert time.monotonic() - began < 1
    assert terminated == LiveCell(Terminated(started.cell_id, []))
    assert await asyncio.wait_for(initial, 1) == Terminated(started.cell_id, [])
    check = await other.execute(ExecuteRequest("c", 'text(String(load("kept")))'))
    assert await check.initial_response() == Result(CellId("2"), [InputText("7")])
