"""The asyncio V1 client glue against a scripted fake host over ``memory_pair()``, with faults."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from codemode.client import RemoteSession, V1ClientConnection, connect_v1
from codemode.client import v1 as client_v1
from codemode.errors import CodeModeError, ConnectionClosed, LocalProtocolError
from codemode.protocol import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    LiveCell,
    Result,
    WaitRequest,
    Yielded,
)
from codemode.protocol.constants import SESSION_RESOURCE_LIMITS_CAPABILITY
from codemode.protocol.v1.lanes import Lane
from codemode.protocol.v1.messages import (
    CellClosed,
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
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
    WireNestedToolCall,
    WireOk,
    WireResultBody,
    WireRuntimeResponse,
    WireToolName,
    WireWaitOutcome,
    WireYielded,
)
from codemode.session import CancellationToken
from codemode.transports.base import TextMessageReceived, TransportError
from tests.client.fakes import ScriptedDelegate, connected
from tests.wire import CLIENT_MESSAGES, RawHost, frame, payloads, raw_host, ready

REQUEST = ExecuteRequest("call-1", "text('x')", [], 1000, None)
S1 = "session-1"
ONE_SECOND = 1.0


def ok_result(cell: str) -> WireRuntimeResponse:
    return WireRuntimeResponse(result=WireResultBody(cell, [], None))


def live(request_id: int, cell: str) -> OperationResponse:
    body = WireRuntimeResponse(yielded=WireYielded(cell, []))
    return OperationResponse(request_id, WireOk(WaitCompleted(WireWaitOutcome(live_cell=body))))


def tool_invoke(delegate_id: int, name: str, value: Any, cell: str = "1") -> DelegateRequestMessage:
    call = WireNestedToolCall(
        cell, f"tool-{delegate_id}", WireToolName(name, None), "function", value
    )
    return DelegateRequestMessage(delegate_id, S1, ToolInvoke(call))


async def open_session(
    connection: V1ClientConnection, host: RawHost, delegate: ScriptedDelegate | None = None
) -> RemoteSession:
    task = asyncio.create_task(connection.open_session(delegate or ScriptedDelegate()))
    request = await host.receive()
    assert isinstance(request, OperationRequest)
    assert isinstance(request.request, SessionOpen)
    host.send(OperationResponse(request.id, WireOk(SessionReady(request.request.session_id))))
    return await task


async def expect_request(host: RawHost, kind: type[Any]) -> OperationRequest:
    message = await host.receive()
    assert isinstance(message, OperationRequest), message
    assert isinstance(message.request, kind), message
    return message


async def started_cell(session: RemoteSession, host: RawHost, cell: str = "1") -> tuple[Any, int]:
    """Execute through the fake host up to admission; returns the StartedCell and request id."""
    task = asyncio.create_task(session.execute(REQUEST))
    request = await expect_request(host, SessionExecute)
    host.send(OperationResponse(request.id, WireOk(ExecutionStarted(cell))))
    return await task, request.id


async def within(seconds: float, awaitable: Any) -> Any:
    async with asyncio.timeout(seconds):
        return await awaitable


# -- handshake ---------------------------------------------------------------------------------


async def test_handshake_hello_and_ready() -> None:
    connection, _ = await connected()
    assert connection.is_alive()
    assert connection.negotiated.resource_limits
    await connection.aclose()
    assert not connection.is_alive()
    assert connection.failure == "code-mode host connection closed"


async def test_hello_is_exact() -> None:
    transport, host = raw_host()
    task = asyncio.create_task(connect_v1(transport))
    hello = await host.handshake()
    assert hello == ConnectionHello((1,), (), (SESSION_RESOURCE_LIMITS_CAPABILITY,))
    await (await task).aclose()


async def handshake_error(script: Any, *, timeout: float = 10.0) -> tuple[CodeModeError, RawHost]:
    transport, host = raw_host()
    task = asyncio.create_task(connect_v1(transport, handshake_timeout=timeout))
    await script(host)
    with pytest.raises(CodeModeError) as caught:
        await within(ONE_SECOND, task)
    return caught.value, host


async def test_handshake_timeout_is_c2() -> None:
    async def silent(host: RawHost) -> None:
        await host.receive()

    error, _ = await handshake_error(silent, timeout=0.05)
    assert error.message == "timed out negotiating with the code-mode host"


async def test_eof_during_handshake_is_c3() -> None:
    async def leave(host: RawHost) -> None:
        await host.receive()
        host.close()

    error, _ = await handshake_error(leave)
    assert error.message == "code-mode host exited during handshake"


async def test_write_failure_during_handshake_is_c3() -> None:
    transport, host = raw_host()
    host.to_host.fail("broken pipe")
    with pytest.raises(CodeModeError, match=r"^code-mode host exited during handshake$"):
        await connect_v1(transport)


@pytest.mark.parametrize(
    ("reply", "text"),
    [
        (
            ConnectionRejected(NoCompatibleVersion((2, 3))),
            "no compatible protocol version (host supports 2, 3)",
        ),
        (
            ConnectionRejected(MissingRequiredCapability("x")),
            "missing required capability `x`",
        ),
    ],
)
async def test_rejection_is_c4(reply: Any, text: str) -> None:
    async def reject(host: RawHost) -> None:
        await host.receive()
        host.send(reply)

    error, _ = await handshake_error(reject)
    assert error.message == "code-mode host rejected the handshake: " + text


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (frame(CellClosed(S1, "1")), "expected connection/ready, got cell/closed"),
        (frame(ConnectionReady(2, ())), "host selected unsupported protocol version 2"),
        (
            frame(ready(("other",))),
            "host granted unrequested capability `other`",
        ),
        (b"\x02\x00\x00\x00{]", "failed to decode code-mode IPC frame: "),
    ],
)
async def test_invalid_reply_is_c5(raw: bytes, detail: str) -> None:
    async def reply(host: RawHost) -> None:
        await host.receive()
        host.inject(raw)

    error, _ = await handshake_error(reply)
    assert error.message.startswith("code-mode host returned an invalid handshake response: ")
    assert detail in error.message


# -- operations ----------------------------------------------------------------------------------


async def test_open_execute_wait_terminate_shutdown() -> None:
    connection, host = await connected()
    delegate = ScriptedDelegate()
    session = await open_session(connection, host, delegate)
    assert session.session_id == S1 and session.is_alive()

    cell, request_id = await started_cell(session, host)
    assert cell.cell_id == CellId("1")
    host.send(ExecuteInitialResponse(request_id, WireOk(ok_result("1"))))
    assert await cell.initial_response() == Result(CellId("1"), [], None)

    wait = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 5)))
    request = await expect_request(host, SessionWait)
    host.send(live(request.id, "1"))
    assert await wait == LiveCell(Yielded(CellId("1"), []))

    terminate = asyncio.create_task(session.terminate(CellId("1")))
    request = await expect_request(host, SessionTerminate)
    host.send(live(request.id, "1"))
    assert await terminate == LiveCell(Yielded(CellId("1"), []))

    host.send(CellClosed(S1, "1"))
    shutdown = asyncio.create_task(session.shutdown())
    second = asyncio.create_task(session.shutdown())  # shares the first
    request = await expect_request(host, SessionShutdown)
    host.send(OperationResponse(request.id, WireOk(SessionClosed(S1))))
    await within(ONE_SECOND, asyncio.gather(shutdown, second))
    await host.nothing()  # one session/shutdown only
    assert delegate.closed == ["1"]
    await session.shutdown()  # idempotent
    with pytest.raises(CodeModeError, match=r"^code mode session is shutting down$"):
        await session.execute(REQUEST)
    await connection.aclose()


async def test_host_errors_fail_only_the_call() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    task = asyncio.create_task(session.execute(REQUEST))
    request = await expect_request(host, SessionExecute)
    host.send(OperationResponse(request.id, WireError("code-mode host has too many active cells")))
    with pytest.raises(CodeModeError, match=r"^code-mode host has too many active cells$"):
        await task
    cell, request_id = await started_cell(session, host)
    host.send(ExecuteInitialResponse(request_id, WireError("remote runtime failed")))
    with pytest.raises(CodeModeError, match=r"^remote runtime failed$"):
        await cell.initial_response()
    assert connection.is_alive()
    await connection.aclose()


async def test_limits_without_capability_are_c7() -> None:
    connection, host = await connected(capabilities=())
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=5)
    with pytest.raises(CodeModeError) as caught:
        await connection.open_session(ScriptedDelegate(), limits)
    assert caught.value.message == (
        "code-mode host does not support session resource limits: "
        "missing `session-cell-execution-resource-limits` capability"
    )
    await host.nothing()
    await connection.aclose()


async def test_limits_with_capability_are_sent() -> None:
    connection, host = await connected()
    limits = CodeModeSessionCellExecutionLimits(max_heap_size_bytes=1 << 20)
    task = asyncio.create_task(connection.open_session(ScriptedDelegate(), limits))
    request = await expect_request(host, SessionOpen)
    assert frame(request).endswith(
        b'"sessionId":"session-1","cellExecutionLimits":{"maxHeapSizeBytes":1048576}}}'
    )
    host.send(OperationResponse(request.id, WireOk(SessionReady(S1))))
    await task
    await connection.aclose()


# -- caller cancellation -----------------------------------------------------------------------


async def test_cancelled_execute_before_admission_is_cancelled_then_terminated() -> None:
    connection, host = await connected()
    delegate = ScriptedDelegate()
    session = await open_session(connection, host, delegate)
    task = asyncio.create_task(session.execute(REQUEST))
    request = await expect_request(host, SessionExecute)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await host.receive() == OperationCancel(request.id)
    host.send(OperationResponse(request.id, WireOk(ExecutionStarted("1"))))  # admitted anyway
    terminate = await expect_request(host, SessionTerminate)
    assert terminate.request == SessionTerminate(S1, "1")
    host.send(ExecuteInitialResponse(request.id, WireOk(ok_result("1"))), live(terminate.id, "1"))
    host.send(CellClosed(S1, "1"))
    await host.nothing()
    assert delegate.closed == ["1"]
    assert connection.is_alive()
    await connection.aclose()


@pytest.mark.parametrize("how", ["cancel", "task", "drop"])
async def test_abandoned_started_cell_is_terminated(how: str) -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    cell, request_id = await started_cell(session, host)
    if how == "cancel":
        cell.cancel()
    elif how == "task":
        waiter = asyncio.create_task(cell.initial_response())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    else:
        del cell
        gc.collect()
    assert await host.receive() == OperationCancel(request_id)
    terminate = await expect_request(host, SessionTerminate)
    assert terminate.request == SessionTerminate(S1, "1")
    await connection.aclose()


async def test_cancelled_wait_defers_the_next_wait() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    first = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 50_000)))
    request = await expect_request(host, SessionWait)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await host.receive() == OperationCancel(request.id)
    second = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 5)))
    await host.nothing()  # queued locally
    host.send(live(request.id, "1"))  # the cancelled wait's (discarded) answer
    later = await expect_request(host, SessionWait)
    host.send(live(later.id, "1"))
    assert await second == LiveCell(Yielded(CellId("1"), []))
    await connection.aclose()


async def test_cancelled_terminate_completes_in_the_background() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    task = asyncio.create_task(session.terminate(CellId("1")))
    request = await expect_request(host, SessionTerminate)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await host.nothing()  # never cancelled on the wire
    host.send(live(request.id, "1"))
    await asyncio.sleep(0.01)
    assert connection.is_alive()
    await connection.aclose()


async def test_cancelled_open_is_shut_down_on_ready() -> None:
    connection, host = await connected()
    task = asyncio.create_task(connection.open_session(ScriptedDelegate()))
    request = await expect_request(host, SessionOpen)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await host.nothing()  # open is never cancelled on the wire
    host.send(OperationResponse(request.id, WireOk(SessionReady(S1))))
    shutdown = await expect_request(host, SessionShutdown)
    assert shutdown.request == SessionShutdown(S1)
    await connection.aclose()


# -- delegate callbacks --------------------------------------------------------------------------


async def test_delegate_results_and_errors() -> None:
    def crash(value: Any, token: CancellationToken) -> Any:
        raise ValueError("kaput")

    def fail(value: Any, token: CancellationToken) -> Any:
        raise CodeModeError("boom")

    delegate = ScriptedDelegate(
        behaviour={
            "echo": lambda value, token: value,
            "fail": fail,
            "crash": crash,
            "odd": lambda value, token: {"x": object()},
        }
    )
    connection, host = await connected()
    session = await open_session(connection, host, delegate)
    cell, _ = await started_cell(session, host)
    assert cell.cell_id == CellId("1")  # kept alive: a dropped StartedCell is abandoned
    host.send(tool_invoke(1, "echo", {"v": [1, "ü"]}))
    assert await host.receive() == DelegateResponseMessage(1, WireOk(ToolResult({"v": [1, "ü"]})))
    host.send(tool_invoke(2, "fail", None))
    assert await host.receive() == DelegateResponseMessage(2, WireError("boom"))
    host.send(tool_invoke(3, "crash", None))
    assert await host.receive() == DelegateResponseMessage(
        3, WireError("code-mode delegate task failed: kaput")
    )
    host.send(tool_invoke(4, "odd", None))
    response = await host.receive()
    assert isinstance(response, DelegateResponseMessage)
    assert isinstance(response.result, WireError)
    assert response.result.message.startswith(
        "code-mode delegate returned a value that is not JSON: "
    )
    host.send(DelegateRequestMessage(5, S1, NotificationSend("call-1", "1", "hello")))
    assert await host.receive() == DelegateResponseMessage(5, WireOk(NotificationDelivered()))
    assert delegate.notes == ["hello"]
    assert connection.is_alive()
    await connection.aclose()


async def test_delegate_cancel_sets_the_token_and_suppresses_the_answer() -> None:
    release = asyncio.Event()

    async def block(value: Any, token: CancellationToken) -> Any:
        await release.wait()
        return "late"

    delegate = ScriptedDelegate(behaviour={"block": block, "echo": lambda v, t: v})
    connection, host = await connected()
    session = await open_session(connection, host, delegate)
    cell, _ = await started_cell(session, host)
    assert cell.cell_id == CellId("1")  # kept alive: a dropped StartedCell is abandoned
    host.send(tool_invoke(1, "block", None))
    await asyncio.sleep(0.01)
    host.send(DelegateCancel(1))
    await asyncio.sleep(0.01)
    assert delegate.tokens[0].is_cancelled()
    release.set()
    await host.nothing()
    host.send(tool_invoke(2, "echo", 1))  # the connection is fine
    assert await host.receive() == DelegateResponseMessage(2, WireOk(ToolResult(1)))
    await connection.aclose()


async def test_cell_closed_fires_after_callbacks_finish() -> None:
    release = asyncio.Event()

    async def ignore_token(value: Any, token: CancellationToken) -> Any:
        await release.wait()
        return None

    delegate = ScriptedDelegate(behaviour={"slow": ignore_token})
    connection, host = await connected()
    session = await open_session(connection, host, delegate)
    cell, _ = await started_cell(session, host)
    assert cell.cell_id == CellId("1")  # kept alive: a dropped StartedCell is abandoned
    host.send(tool_invoke(1, "slow", None))
    await asyncio.sleep(0.01)
    host.send(CellClosed(S1, "1"))
    await asyncio.sleep(0.01)
    assert delegate.tokens[0].is_cancelled()
    assert delegate.closed == []
    release.set()
    await asyncio.sleep(0.01)
    assert delegate.closed == ["1"]
    await host.nothing()  # the answer was suppressed
    await connection.aclose()


async def test_early_callback_is_parked_until_execution_started() -> None:
    delegate = ScriptedDelegate(behaviour={"echo": lambda v, t: v})
    connection, host = await connected()
    session = await open_session(connection, host, delegate)
    task = asyncio.create_task(session.execute(REQUEST))
    request = await expect_request(host, SessionExecute)
    host.send(tool_invoke(1, "echo", 5))
    await host.nothing()
    host.send(OperationResponse(request.id, WireOk(ExecutionStarted("1"))))
    assert await host.receive() == DelegateResponseMessage(1, WireOk(ToolResult(5)))
    await task
    await connection.aclose()


# -- connection failure --------------------------------------------------------------------------


async def pending_everything(
    connection: V1ClientConnection, host: RawHost
) -> tuple[RemoteSession, ScriptedDelegate, list[asyncio.Task[Any]]]:
    """A session with a started cell and one pending call of every kind."""
    delegate = ScriptedDelegate(behaviour={"wait": lambda v, t: t.wait_cancelled()})
    session = await open_session(connection, host, delegate)
    cell, _ = await started_cell(session, host, "1")
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(cell.initial_response())]
    tasks.append(asyncio.create_task(session.execute(REQUEST)))
    await expect_request(host, SessionExecute)
    tasks.append(asyncio.create_task(session.wait(WaitRequest(CellId("1"), 60_000))))
    await expect_request(host, SessionWait)
    tasks.append(asyncio.create_task(session.terminate(CellId("1"))))
    await expect_request(host, SessionTerminate)
    tasks.append(asyncio.create_task(connection.open_session(ScriptedDelegate())))
    await expect_request(host, SessionOpen)
    host.send(tool_invoke(1, "wait", None))
    await asyncio.sleep(0.01)
    assert len(delegate.tokens) == 1
    return session, delegate, tasks


async def assert_all_fail(tasks: list[asyncio.Task[Any]], reason: str) -> None:
    results = await within(ONE_SECOND, asyncio.gather(*tasks, return_exceptions=True))
    for result in results:
        assert isinstance(result, ConnectionClosed), result
        assert result.message == reason


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("eof", "code-mode host connection closed"),
        (
            "garbage",
            "failed to read code-mode host message: failed to decode code-mode IPC frame: ",
        ),
        (
            "truncated",
            "failed to read code-mode host message: "
            "code-mode IPC frame length prefix truncated after 2 bytes",
        ),
        ("unknown-id", "code-mode host returned unknown request ID 999"),
        ("second-ready", "code-mode host sent a second handshake response"),
        ("write", "failed to write code-mode host message: injected write failure"),
    ],
)
async def test_connection_death_fails_every_pending_call(fault: str, reason: str) -> None:
    connection, host = await connected()
    session, delegate, tasks = await pending_everything(connection, host)
    if fault == "eof":
        host.close()
    elif fault == "garbage":
        host.to_client.inject(b"\x03\x00\x00\x00[1,")
    elif fault == "truncated":
        host.to_client.inject(b"\x01\x00")
        host.close()
    elif fault == "unknown-id":
        host.send(OperationResponse(999, WireOk(SessionReady(S1))))
    elif fault == "second-ready":
        host.send(ready(()))
    else:
        host.to_host.fail()
        tasks.append(asyncio.create_task(session.wait(WaitRequest(CellId("2"), 1))))
    results = await within(ONE_SECOND, asyncio.gather(*tasks, return_exceptions=True))
    for result in results:
        assert isinstance(result, ConnectionClosed), result
        assert result.message.startswith(reason)
    recorded = connection.failure
    assert recorded is not None and recorded.startswith(reason)
    assert not session.is_alive()
    # The delegate's token is set and, once it returns, cell_closed fires exactly once.
    assert delegate.tokens[0].is_cancelled()
    await asyncio.sleep(0.01)
    assert delegate.closed == ["1"]
    # Every later call raises the recorded reason at once; shutdown succeeds.
    with pytest.raises(ConnectionClosed) as caught:
        await session.wait(WaitRequest(CellId("1"), 1))
    assert caught.value.message == recorded
    with pytest.raises(ConnectionClosed):
        await connection.open_session(ScriptedDelegate())
    await within(ONE_SECOND, session.shutdown())
    assert delegate.closed == ["1"]
    await connection.aclose()
    assert connection.failure == recorded  # the first reason wins


async def test_dropped_answer_leaves_call_pending_until_the_connection_dies() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    host.to_client.drop()
    task = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 1)))
    request = await expect_request(host, SessionWait)
    host.send(live(request.id, "1"))  # lost
    await asyncio.sleep(0.05)
    assert not task.done()
    host.close()
    with pytest.raises(ConnectionClosed, match=r"^code-mode host connection closed$"):
        await within(ONE_SECOND, task)


async def test_held_and_split_frames_are_delivered_intact() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    host.to_client.split(1)
    host.to_client.hold()
    cell_task = asyncio.create_task(started_cell(session, host))
    await asyncio.sleep(0.02)
    assert not cell_task.done()
    host.to_client.release()
    cell, request_id = await within(ONE_SECOND, cell_task)
    host.send(ExecuteInitialResponse(request_id, WireOk(ok_result("1"))))
    assert await within(ONE_SECOND, cell.initial_response()) == Result(CellId("1"), [], None)
    await connection.aclose()


async def test_shutdown_pending_when_the_connection_dies_fails_but_a_later_one_succeeds() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    task = asyncio.create_task(session.shutdown())
    await expect_request(host, SessionShutdown)
    host.close()
    with pytest.raises(ConnectionClosed, match=r"^code-mode host connection closed$"):
        await within(ONE_SECOND, task)
    await within(ONE_SECOND, session.shutdown())


async def test_request_id_exhaustion_kills_the_connection() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    connection.protocol._next_request_id = 2**63  # white-box: skip 2^63 requests
    with pytest.raises(LocalProtocolError, match=r"^code-mode host request ID space exhausted$"):
        await session.wait(WaitRequest(CellId("1"), 1))
    assert not connection.is_alive()
    with pytest.raises(ConnectionClosed, match=r"^code-mode host request ID space exhausted$"):
        await session.wait(WaitRequest(CellId("1"), 1))


async def test_request_id_exhaustion_fails_every_pending_call() -> None:
    connection, host = await connected()
    session = await open_session(connection, host)
    reasons: list[str] = []
    connection.add_death_callback(reasons.append)
    pending = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 60_000)))
    await expect_request(host, SessionWait)
    connection.protocol._next_request_id = 2**63  # white-box: skip 2^63 requests
    with pytest.raises(LocalProtocolError):
        await session.wait(WaitRequest(CellId("1"), 1))
    await assert_all_fail([pending], "code-mode host request ID space exhausted")
    assert reasons == ["code-mode host request ID space exhausted"]
    await within(ONE_SECOND, connection.wait_closed())
    await host.expect_end()


# -- dual carriers (lanes) -----------------------------------------------------------------------


class DualMemoryTransport:
    """A two-lane carrier for lane tests: frames are queued whole, tagged with their lane."""

    dual = True
    whole_frames = True

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[tuple[bytes, Lane] | BaseException | None] = asyncio.Queue()
        self.sent: list[tuple[bytes, Lane]] = []
        self.closed = False

    def send(self, frame: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        if self.closed:
            raise TransportError("closed")
        self.sent.append((bytes(frame), lane))

    async def drain(self) -> None:
        return None

    def backlogged(self) -> bool:
        return False

    async def receive(self) -> tuple[bytes, Lane] | None:
        item = await self.incoming.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        self.closed = True
        self.incoming.put_nowait(None)

    def feed(self, message: Any, lane: Lane = Lane.CONTROL) -> None:
        self.incoming.put_nowait((frame(message), lane))


async def dual_connection(bulk_opened: list[str]) -> tuple[V1ClientConnection, DualMemoryTransport]:
    transport = DualMemoryTransport()
    transport.feed(ready(("dual-websocket-v1", SESSION_RESOURCE_LIMITS_CAPABILITY), "tok"))

    async def open_bulk(token: str) -> None:
        bulk_opened.append(token)

    connection = await connect_v1(transport, dual=True, open_bulk=open_bulk)
    return connection, transport


def decode_sent(data: bytes) -> ClientToHost:
    (payload,) = payloads(data)
    return CLIENT_MESSAGES.decode(payload)


async def test_dual_connection_lanes() -> None:
    opened: list[str] = []
    connection, transport = await dual_connection(opened)
    assert opened == ["tok"]
    hello = decode_sent(transport.sent[0][0])
    assert isinstance(hello, ConnectionHello)
    assert hello.optional_capabilities == ("dual-websocket-v1", SESSION_RESOURCE_LIMITS_CAPABILITY)
    delegate = ScriptedDelegate(behaviour={"echo": lambda v, t: v})
    task = asyncio.create_task(connection.open_session(delegate))
    await asyncio.sleep(0)
    transport.feed(OperationResponse(1, WireOk(SessionReady(S1))))
    session = await task
    task2 = asyncio.create_task(session.execute(REQUEST))
    await asyncio.sleep(0)
    transport.feed(OperationResponse(2, WireOk(ExecutionStarted("1"))))
    cell = await task2
    transport.feed(tool_invoke(1, "echo", 1), Lane.BULK)
    transport.feed(DelegateRequestMessage(2, S1, NotificationSend("c", "1", "t")), Lane.CONTROL)
    await asyncio.sleep(0.02)
    delegate.notify_error = CodeModeError("not now")
    transport.feed(DelegateRequestMessage(3, S1, NotificationSend("c", "1", "u")), Lane.CONTROL)
    await asyncio.sleep(0.02)
    sent = [(decode_sent(frame), lane) for frame, lane in transport.sent[1:]]
    assert [(type(m).__name__, lane) for m, lane in sent[:2]] == [
        ("OperationRequest", Lane.CONTROL),
        ("OperationRequest", Lane.CONTROL),
    ]
    assert sent[2:] == [
        (DelegateResponseMessage(1, WireOk(ToolResult(1))), Lane.BULK),
        (DelegateResponseMessage(2, WireOk(NotificationDelivered())), Lane.CONTROL),
        (DelegateResponseMessage(3, WireError("not now")), Lane.BULK),
    ]
    assert cell.cell_id == CellId("1")
    # A tool/invoke on the control socket is a connection error.
    transport.feed(tool_invoke(3, "echo", 1), Lane.CONTROL)
    await asyncio.sleep(0.02)
    assert connection.failure == "code-mode host sent delegate/request on the control socket"
    await connection.aclose()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (TextMessageReceived("text"), "code-mode host sent a text WebSocket message"),
        (TransportError("reset"), "failed to read code-mode host message: reset"),
    ],
    ids=["text-message-k7", "broken-carrier-k3"],
)
async def test_carrier_errors_end_the_connection(error: TransportError, reason: str) -> None:
    opened: list[str] = []
    connection, transport = await dual_connection(opened)
    transport.incoming.put_nowait(error)
    await asyncio.sleep(0.02)
    assert connection.failure == reason


async def test_a_dual_connection_needs_open_bulk() -> None:
    with pytest.raises(ValueError, match="open_bulk"):
        await connect_v1(DualMemoryTransport(), dual=True)


async def test_dual_grant_without_bulk_carrier_is_c6() -> None:
    transport = DualMemoryTransport()
    transport.feed(ready(("dual-websocket-v1",), "tok"))

    async def no_bulk(token: str) -> None:
        raise OSError("refused")

    with pytest.raises(
        CodeModeError, match=r"^code-mode host bulk connection is unavailable: refused$"
    ):
        await connect_v1(transport, dual=True, open_bulk=no_bulk)
    assert transport.closed


# -- a host that goes silent -------------------------------------------------------------------

SILENT_ALLOWANCE = 0.2


@pytest.mark.timeout(30)
async def test_a_silent_host_fails_every_pending_call_at_the_first_deadline() -> None:
    # The rule of grpc.md §13.3: 60 s (here 0.2 s) past the runtime allowance (yield + 1 s).
    connection, host = await connected(response_timeout=SILENT_ALLOWANCE)
    session = await open_session(connection, host)
    execute = asyncio.create_task(session.execute(ExecuteRequest("c", "x", [], 0, None)))
    request = await expect_request(host, SessionExecute)
    host.send(OperationResponse(request.id, WireOk(ExecutionStarted("1"))))
    cell = await within(ONE_SECOND, execute)
    loop = asyncio.get_running_loop()
    started = loop.time()
    initial = asyncio.ensure_future(cell.initial_response())
    wait = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 3000)))
    await expect_request(host, SessionWait)
    await asyncio.sleep(1.0)
    assert not initial.done() and not wait.done() and connection.is_alive()
    reason = "code-mode host timed out waiting for execution response"
    for pending in (initial, wait):
        with pytest.raises(ConnectionClosed, match=f"^{reason}$"):
            await within(ONE_SECOND, pending)
    assert 1.2 <= loop.time() - started < 1.8
    assert connection.failure == reason and not session.is_alive()
    with pytest.raises(ConnectionClosed, match=f"^{reason}$"):
        await session.terminate(CellId("1"))


@pytest.mark.parametrize(
    ("operation", "kind", "call"),
    [
        ("termination", SessionTerminate, lambda s: s.terminate(CellId("1"))),
        ("session shutdown", SessionShutdown, lambda s: s.shutdown()),
    ],
)
@pytest.mark.timeout(30)
async def test_terminate_and_shutdown_have_deadlines_too(
    monkeypatch: pytest.MonkeyPatch, operation: str, kind: type[Any], call: Any
) -> None:
    monkeypatch.setattr(client_v1, "SHUTDOWN_TIMEOUT", 0.1, raising=False)
    connection, host = await connected(response_timeout=SILENT_ALLOWANCE)
    session = await open_session(connection, host)
    task = asyncio.create_task(call(session))
    await expect_request(host, kind)
    with pytest.raises(
        ConnectionClosed, match=f"^code-mode host timed out waiting for {operation}"
    ):
        await within(ONE_SECOND, task)


@pytest.mark.timeout(30)
async def test_answers_in_time_disarm_their_deadlines() -> None:
    connection, host = await connected(response_timeout=SILENT_ALLOWANCE)
    session = await open_session(connection, host)
    cell, request_id = await started_cell(session, host)
    host.send(ExecuteInitialResponse(request_id, WireOk(ok_result("1"))))
    await within(ONE_SECOND, cell.initial_response())
    wait = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 0)))
    host.send(live((await expect_request(host, SessionWait)).id, "1"))
    await within(ONE_SECOND, wait)
    await asyncio.sleep(1.5 + SILENT_ALLOWANCE)  # past every deadline of those requests
    assert connection.is_alive()
    await connection.aclose()


@pytest.mark.timeout(30)
async def test_a_held_back_wait_gets_its_time_once_sent() -> None:
    connection, host = await connected(response_timeout=SILENT_ALLOWANCE)
    session = await open_session(connection, host)
    first = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 2000)))
    first_id = (await expect_request(host, SessionWait)).id
    first.cancel()
    assert isinstance(await host.receive(), OperationCancel)
    second = asyncio.create_task(session.wait(WaitRequest(CellId("1"), 0)))  # held back (§9.4)
    await asyncio.sleep(1.5)  # past the held-back wait's 1.2 s, had it counted from the start
    assert connection.is_alive() and not second.done()
    host.send(live(first_id, "1"))
    host.send(live((await expect_request(host, SessionWait)).id, "1"))
    assert isinstance(await within(ONE_SECOND, second), LiveCell)
    await connection.aclose()


@pytest.mark.timeout(30)
async def test_a_host_waiting_for_our_notification_to_be_delivered_is_not_silent() -> None:
    # Guards: a cell's yield waits until its notifications were delivered, so while the client's
    # own delegate still delivers one the host's silence is ours: the connection is not failed
    # with "host timed out" for it.
    release = asyncio.Event()

    class SlowToNotify(ScriptedDelegate):
        async def notify(
            self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
        ) -> None:
            await release.wait()

    connection, host = await connected(response_timeout=SILENT_ALLOWANCE)
    session = await open_session(connection, host, SlowToNotify())
    execute = asyncio.create_task(session.execute(ExecuteRequest("c", "x", [], 0, None)))
    request = await expect_request(host, SessionExecute)
    host.send(OperationResponse(request.id, WireOk(ExecutionStarted("1"))))
    cell = await within(ONE_SECOND, execute)
    host.send(DelegateRequestMessage(1, S1, NotificationSend("c", "1", "hello")))
    await asyncio.sleep(1.5)  # past the execute's 1.2 s
    assert connection.is_alive()
    release.set()
    assert await host.receive() == DelegateResponseMessage(1, WireOk(NotificationDelivered()))
    host.send(ExecuteInitialResponse(request.id, WireOk(ok_result("1"))))
    await within(ONE_SECOND, cell.initial_response())
    assert connection.is_alive()
    await connection.aclose()
