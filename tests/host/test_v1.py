"""The asyncio V1 host glue (``serve_v1_connection``) against the real embedded runtime, driven by
raw frames over ``memory_pair()`` (``protocol-v1.md`` §3, §4.8, §6, §8)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from codemode.errors import CodeModeError
from codemode.host import HostOptions, serve_v1_connection
from codemode.protocol import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
)
from codemode.protocol.constants import (
    MAX_FRAME_BYTES,
    MAX_PENDING_DELEGATE_CALLS,
)
from codemode.protocol.v1.codec import MessageDecoder
from codemode.protocol.v1.messages import (
    CellClosed,
    ClientToHost,
    ConnectionRejected,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostToClient,
    InvalidHello,
    NoCompatibleVersion,
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
from codemode.runtime import LocalSessionProvider
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
)
from codemode.transports.stream import StreamTransport, pipe_transport
from tests.polling import eventually, live_cells
from tests.wire import HELLO, FrameReader, RawClient, frame, hello, raw_client, ready

CLIENT_READ = MessageDecoder[HostToClient](HostToClient)

S1 = "session-1"
ECHO = WireToolDefinition("echo", WireToolName("echo", None), "", "function", None, None)
BLOCK = WireToolDefinition("block", WireToolName("block", None), "", "function", None, None)
J1 = "code-mode host exceeded the limit of 1024 pending delegate calls"
J4 = "code-mode client connection closed"


@dataclass
class Served:
    client: RawClient
    task: asyncio.Task[bool]

    async def result(self, timeout: float = 5.0) -> bool:
        async with asyncio.timeout(timeout):
            return await self.task


@contextlib.asynccontextmanager
async def serving(
    provider: CodeModeSessionProvider, options: HostOptions | None = None
) -> AsyncIterator[Served]:
    transport, client = raw_client()
    task = asyncio.create_task(serve_v1_connection(transport, provider, options))
    served = Served(client, task)
    try:
        yield served
    finally:
        client.close()
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(10):
                await task
        if not task.done():  # pragma: no cover - only when a test already failed
            task.cancel()


def running_cells(provider: LocalSessionProvider) -> int:
    """Cells the provider's engines still run."""
    return provider.live_cells


async def cells_stopped(provider: LocalSessionProvider, deadline: float) -> None:
    """Every cell of the engine stopped by ``deadline`` (loop time).

    Polled: ``LocalSession.shutdown()`` does not wait for a cell that an abandonment is already
    terminating, so the last isolate may stop a moment after ``serve_v1_connection`` returned.
    """
    loop = asyncio.get_running_loop()
    while running_cells(provider) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert running_cells(provider) == 0, f"{running_cells(provider)} cells still running"


def ok(request_id: int, value: Any) -> OperationResponse:
    return OperationResponse(request_id, WireOk(value))


# -- §4.8: the example conversation -----------------------------------------------------------------

EXAMPLE = [
    (
        "C",
        b'{"type":"connection/hello","supportedVersions":[1],"requiredCapabilities":[],'
        b'"optionalCapabilities":["session-cell-execution-resource-limits"]}',
    ),
    (
        "H",
        b'{"type":"connection/ready","selectedVersion":1,'
        b'"capabilities":["session-cell-execution-resource-limits"]}',
    ),
    (
        "C",
        b'{"type":"operation/request","id":1,"request":{"method":"session/open",'
        b'"sessionId":"session-1","cellExecutionLimits":{"maxYieldTimeMs":250}}}',
    ),
    (
        "H",
        b'{"type":"operation/response","id":1,"result":{"status":"ok",'
        b'"value":{"type":"session/ready","sessionId":"session-1"}}}',
    ),
    (
        "C",
        b'{"type":"operation/request","id":2,"request":{"method":"session/execute",'
        b'"sessionId":"session-1","request":{"tool_call_id":"call-1","enabled_tools":[{"name":'
        b'"echo","tool_name":{"name":"echo","namespace":null},"description":"","kind":"function",'
        b'"input_schema":null,"output_schema":null}],"source":"const r = await tools.echo({value:'
        b'\\"ping\\"}); text(r.value);","yield_time_ms":5000,"max_output_tokens":1000}}}',
    ),
    (
        "H",
        b'{"type":"operation/response","id":2,"result":{"status":"ok",'
        b'"value":{"type":"execution/started","cellId":"1"}}}',
    ),
    (
        "H",
        b'{"type":"delegate/request","id":1,"sessionId":"session-1","request":{"type":'
        b'"tool/invoke","invocation":{"cell_id":"1","runtime_tool_call_id":"tool-1","tool_name":'
        b'{"name":"echo","namespace":null},"tool_kind":"function","input":{"value":"ping"}}}}',
    ),
    (
        "C",
        b'{"type":"delegate/response","id":1,"result":{"status":"ok",'
        b'"value":{"type":"tool/result","result":{"value":"pong"}}}}',
    ),
    (
        "H",
        b'{"type":"execute/initialResponse","id":2,"result":{"status":"ok","value":{"Result":'
        b'{"cell_id":"1","content_items":[{"type":"input_text","text":"pong"}],'
        b'"error_text":null}}}}',
    ),
    ("H", b'{"type":"cell/closed","sessionId":"session-1","cellId":"1"}'),
    (
        "C",
        b'{"type":"operation/request","id":3,"request":{"method":"session/shutdown",'
        b'"sessionId":"session-1"}}',
    ),
    (
        "H",
        b'{"type":"operation/response","id":3,"result":{"status":"ok",'
        b'"value":{"type":"session/closed","sessionId":"session-1"}}}',
    ),
]


async def test_the_example_conversation(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        for direction, payload in EXAMPLE:
            if direction == "C":
                client.inject(frame(payload))
            else:
                assert await client.receive_raw() == payload
        await client.nothing(0.1)
        client.close()
        assert await served.result() is True
        await client.expect_end()


async def test_split_frames_are_reassembled(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        served.client.to_host.split(1)
        served.client.to_client.split(3)
        await served.client.handshake()
        await served.client.open()
        cell = await served.client.execute(2, "text('x')")
        assert await served.client.receive() == ExecuteInitialResponse(
            2, WireOk(WireRuntimeResponse(result=WireResultBody(cell, [WireInputText("x")], None)))
        )
        assert await served.client.receive() == CellClosed(S1, cell)


# -- the first frame (§3.3) -----------------------------------------------------------------------

BAD_FIRST_FRAMES: dict[str, bytes] = {
    "garbage": frame(b"\xff\xfe garbage"),
    "not-json": frame(b"hello"),
    "empty-payload": frame(b""),
    "oversize": (MAX_FRAME_BYTES + 1).to_bytes(4, "little") + b"{}",
    "huge-prefix": b"\xff\xff\xff\xff",
    "unknown-field": frame(
        b'{"type":"connection/hello","supportedVersions":[1],"requiredCapabilities":[],'
        b'"optionalCapabilities":[],"extra":1}'
    ),
    "unknown-tag": frame(b'{"type":"connection/helo","supportedVersions":[1]}'),
    "empty-versions": frame(
        b'{"type":"connection/hello","supportedVersions":[],"requiredCapabilities":[],'
        b'"optionalCapabilities":[]}'
    ),
    "overlapping-capabilities": frame(
        b'{"type":"connection/hello","supportedVersions":[1],"requiredCapabilities":["a"],'
        b'"optionalCapabilities":["a"]}'
    ),
    "duplicate-key": frame(
        b'{"type":"connection/hello","supportedVersions":[1],"supportedVersions":[1],'
        b'"requiredCapabilities":[],"optionalCapabilities":[]}'
    ),
    "nan": frame(b'{"type":"operation/cancel","id":NaN}'),
    "json-array": frame(b"[1,2,3]"),
}


@pytest.mark.parametrize("data", BAD_FIRST_FRAMES.values(), ids=BAD_FIRST_FRAMES.keys())
async def test_a_bad_first_frame_closes_without_a_reply(
    provider: LocalSessionProvider, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codemode.host")
    async with serving(provider) as served:
        served.client.inject(data)
        assert await served.result() is False
        await served.client.expect_end()
    assert next(record.getMessage() for record in caplog.records).startswith(
        "failed to read code-mode client hello: "
    )


@pytest.mark.parametrize(
    "data",
    [b"\x01\x00", b'\x10\x00\x00\x00{"type"', frame(b"{}")[:-1]],
    ids=["truncated-prefix", "truncated-payload", "truncated-by-one"],
)
async def test_a_truncated_first_frame_closes_without_a_reply(
    provider: LocalSessionProvider, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codemode.host")
    async with serving(provider) as served:
        served.client.inject(data)
        await served.client.nothing(0.1)  # waits for the rest of the frame
        assert not served.task.done()
        served.client.close()
        assert await served.result() is False
        await served.client.expect_end()
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("failed to read code-mode client hello: code-mode IPC frame")


async def test_eof_before_any_byte_is_a_silent_clean_end(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codemode.host")
    async with serving(provider) as served:
        served.client.close()
        assert await served.result() is True
        await served.client.expect_end()
    assert caplog.records == []


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (OperationCancel(1), InvalidHello("first message must be connection/hello")),
        (
            OperationRequest(1, SessionOpen(S1)),
            InvalidHello("first message must be connection/hello"),
        ),
        (hello((), versions=(2,)), NoCompatibleVersion((1,))),
    ],
)
async def test_a_rejected_hello_is_answered_then_closed(
    provider: LocalSessionProvider, first: ClientToHost, reason: Any
) -> None:
    async with serving(provider) as served:
        served.client.send(first)
        assert await served.client.receive() == ConnectionRejected(reason)
        await served.client.expect_end()
        assert await served.result() is True


async def test_invalid_hello_bytes(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        served.client.inject(frame(b'{"type":"operation/cancel","id":1}'))
        assert await served.client.receive_raw() == (
            b'{"type":"connection/rejected","reason":{"type":"invalidHello",'
            b'"message":"first message must be connection/hello"}}'
        )


async def test_a_write_failure_during_the_handshake_ends_the_connection(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        served.client.to_client.fail("broken pipe")
        served.client.send(HELLO)
        assert await served.result() is False


# -- errors after the handshake (§6.2, §8.9) --------------------------------------------------------

BAD_LATER_FRAMES: dict[str, bytes] = {
    **BAD_FIRST_FRAMES,
    "second-hello": frame(HELLO),
    "duplicate-request-id": frame(OperationRequest(2, SessionOpen("session-2"))),
    "unknown-delegate-id": frame(DelegateResponseMessage(77, WireOk(ToolResult(None)))),
    "wrong-variant-tag": frame(b'{"type":"operation/yield","id":5}'),
    "null-for-required": frame(b'{"type":"operation/cancel","id":null}'),
    "float-id": frame(b'{"type":"operation/cancel","id":1.0}'),
    "lone-surrogate": frame(
        b'{"type":"operation/request","id":9,"request":{"method":'
        b'"session/open","sessionId":"\\ud800"}}'
    ),
}
LOG_TEXT = {
    "second-hello": "received a second code-mode client hello",
    "duplicate-request-id": "duplicate code-mode request ID 2",
    "unknown-delegate-id": "code-mode client returned unknown delegate request ID 77",
}


@pytest.mark.parametrize("name", BAD_LATER_FRAMES.keys())
async def test_a_connection_error_stops_the_host_and_nothing_more_is_written(
    provider: LocalSessionProvider, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codemode.host")
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        # A cell whose answers would come later: none of them may be written after the error.
        source = "text('a'); await new Promise((r) => setTimeout(r, 2000)); text('b');"
        await client.execute(2, source, yield_ms=60_000)
        client.inject(BAD_LATER_FRAMES[name])
        assert await served.result() is False
        await client.expect_end()
        await cells_stopped(provider, asyncio.get_running_loop().time() + 1.0)
    messages = [record.getMessage() for record in caplog.records]
    expected = LOG_TEXT.get(name, "failed to read code-mode client message: ")
    assert any(message.startswith(expected) for message in messages), messages


async def test_a_truncated_frame_at_eof_after_the_handshake_is_a_connection_error(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codemode.host")
    async with serving(provider) as served:
        await served.client.handshake()
        served.client.inject(b"\x20\x00\x00\x00{")
        served.client.close()
        assert await served.result() is False
        await served.client.expect_end()
    assert any(
        record.getMessage() == "failed to read code-mode client message: "
        "code-mode IPC frame payload truncated: declared 32 bytes, received 1"
        for record in caplog.records
    )


async def test_eof_after_the_handshake_is_a_clean_end(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        await served.client.handshake()
        await served.client.open()
        served.client.close()
        assert await served.result() is True
        await served.client.expect_end()


async def test_a_write_failure_ends_the_connection(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        await client.execute(2, "while (true) {}", yield_ms=60_000)
        client.to_client.fail("broken pipe")
        client.send(OperationRequest(3, SessionOpen("session-2")))  # its answer cannot be written
        # The host ends the connection on its own: the client never closes its side.
        assert await served.result(1.0) is False
        await cells_stopped(provider, asyncio.get_running_loop().time() + 1.0)


# -- the end of a connection frees its cells (§8.4) ---------------------------------------------


@dataclass
class Recorder(CodeModeSessionDelegate):
    """Wraps the host's delegate to record what the runtime's tool calls came back with."""

    inner: CodeModeSessionDelegate
    outcomes: list[str] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        try:
            value = await self.inner.invoke_tool(invocation, cancellation)
        except CodeModeError as error:
            self.outcomes.append(error.message)
            self.settled.set()
            raise
        self.outcomes.append(f"ok {value!r}")
        self.settled.set()
        return value

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        await self.inner.notify(call_id, cell_id, text, cancellation)

    def cell_closed(self, cell_id: CellId) -> None:
        self.inner.cell_closed(cell_id)


class RecordingProvider(CodeModeSessionProvider):
    """A LocalSessionProvider whose sessions' delegates are wrapped in a :class:`Recorder`."""

    def __init__(self, inner: LocalSessionProvider) -> None:
        self.inner = inner
        self.recorders: list[Recorder] = []

    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self, delegate: CodeModeSessionDelegate, limits: CodeModeSessionCellExecutionLimits
    ) -> CodeModeSession:
        recorder = Recorder(delegate)
        self.recorders.append(recorder)
        return await self.inner.create_session_with_limits(recorder, limits)


async def test_client_eof_frees_every_cell_within_one_second(
    provider: LocalSessionProvider,
) -> None:
    recording = RecordingProvider(provider)
    async with serving(recording) as served:
        client = served.client
        await client.handshake()
        await client.open()
        await client.execute(2, "while (true) {}", yield_ms=60_000)
        blocked = "try { await tools.block({}); } catch (e) { while (true) {} }"
        await client.execute(3, blocked, tools=(BLOCK,), yield_ms=60_000)
        request = await client.receive()
        assert isinstance(request, DelegateRequestMessage)
        assert isinstance(request.request, ToolInvoke)
        await client.execute(4, "while (true) {}", yield_ms=0)  # yielded at once: still running
        assert isinstance(await client.receive(), ExecuteInitialResponse)
        await asyncio.sleep(0.2)
        assert running_cells(provider) == 3
        loop = asyncio.get_running_loop()
        began = loop.time()
        client.close()
        assert await served.result() is True
        assert loop.time() - began < 1.0
        await cells_stopped(provider, began + 1.0)
        await client.expect_end()  # nothing was written after the end: no cell/closed
    # The pending tool call was failed with J4 (what the JavaScript promise rejected with).
    assert recording.recorders[0].outcomes == [J4]


async def test_a_pending_tool_call_rejects_with_j4_when_the_client_disappears(
    provider: LocalSessionProvider,
) -> None:
    recording = RecordingProvider(provider)
    async with serving(recording) as served:
        client = served.client
        await client.handshake()
        await client.open()
        source = "await tools.echo({}); text('never');"
        await client.execute(2, source, tools=(ECHO,), yield_ms=60_000)
        assert isinstance(await client.receive(), DelegateRequestMessage)
        client.close()
        assert await served.result() is True
    assert recording.recorders[0].outcomes == [J4]


async def test_a_connection_that_ends_while_a_cell_waits_for_its_notification_fails_no_task(
    provider: LocalSessionProvider,
) -> None:
    # The cell's end waited for its notification; the connection's end cancelled the initial
    # response's waiter and the notification, and the end then went to that cancelled waiter
    # before it had detached: "Task exception was never retrieved ... InvalidStateError".
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        async with serving(provider) as served:
            client = served.client
            await client.handshake()
            await client.open()
            await client.execute(2, 'notify("x"); text(1)', yield_ms=2000)
            while not isinstance(await client.receive(), DelegateRequestMessage):
                pass
            client.close()
            assert await served.result() is True
        gc.collect()
        await asyncio.sleep(0.1)
    finally:
        loop.set_exception_handler(None)
    assert errors == []


# -- callbacks ----------------------------------------------------------------------------------------


async def test_callbacks_past_1024_are_refused_and_notifications_dropped(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codemode.host")
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        source = (
            "const calls = [];\n"
            "for (let i = 0; i < 1027; i++) {\n"
            "  calls.push(tools.echo({ i }).then((v) => 'ok ' + v.i, (e) => 'error ' + e));\n"
            "}\n"
            "text(JSON.stringify(await Promise.all(calls.slice(1024))));\n"
            "notify('over the limit');\n"
            "yield_control();\n"
            "text(JSON.stringify(await Promise.all(calls.slice(0, 2))));\n"
        )
        await client.execute(2, source, tools=(ECHO,), yield_ms=60_000)
        requests = [await client.receive() for _ in range(MAX_PENDING_DELEGATE_CALLS)]
        ids = [r.id for r in requests if isinstance(r, DelegateRequestMessage)]
        assert ids == list(range(1, MAX_PENDING_DELEGATE_CALLS + 1))
        # The three calls over the cap rejected at once; the notification was dropped.
        over = json.dumps([f"error {J1}"] * 3, separators=(",", ":"))
        expected = WireYielded("1", [WireInputText(over)])
        assert await client.receive() == ExecuteInitialResponse(
            2, WireOk(WireRuntimeResponse(yielded=expected))
        )
        await client.nothing(0.2)  # no notification/send
        assert any(
            record.getMessage() == f"failed to deliver code mode notification: {J1}"
            for record in caplog.records
        )
        # Capacity returns as the client answers.
        client.send(
            DelegateResponseMessage(1, WireOk(ToolResult({"i": 0}))),
            DelegateResponseMessage(2, WireOk(ToolResult({"i": 1}))),
        )
        client.send(OperationRequest(3, SessionWait(S1, WireWaitRequest("1", 60_000))))
        body = WireRuntimeResponse(
            result=WireResultBody("1", [WireInputText('["ok 0","ok 1"]')], None)
        )
        # The cell completed: its 1022 unanswered calls are revoked (newest first, as upstream
        # revokes them), then it closes.
        messages = await client.receive_until(CellClosed(S1, "1"))
        assert messages[-2:] == [
            ok(3, WaitCompleted(WireWaitOutcome(live_cell=body))),
            CellClosed(S1, "1"),
        ]
        assert messages[:-2] == [DelegateCancel(i) for i in range(1024, 2, -1)]  # newest first


async def test_a_notification_reaches_the_client(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        cell = await client.execute(2, "notify('hello'); text('done');")
        message = await client.receive()
        assert message == DelegateRequestMessage(1, S1, NotificationSend("call-1", cell, "hello"))
        client.inject(
            frame(
                b'{"type":"delegate/response","id":1,"result":{"status":"ok",'
                b'"value":{"type":"notification/delivered"}}}'
            )
        )
        result = await client.receive()
        assert isinstance(result, ExecuteInitialResponse)
        assert await client.receive() == CellClosed(S1, cell)


async def test_tool_errors_and_wrong_variants_reach_the_javascript(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        source = (
            "const out = [];\n"
            "for (let i = 0; i < 2; i++) {\n"
            "  try { await tools.echo({}); } catch (e) { out.push(e); }\n"
            "}\n"
            "text(JSON.stringify(out));\n"
        )
        cell = await client.execute(2, source, tools=(ECHO,))
        first = await client.receive()
        assert isinstance(first, DelegateRequestMessage)
        client.send(DelegateResponseMessage(first.id, WireError("tool broke")))
        second = await client.receive()
        assert isinstance(second, DelegateRequestMessage)
        client.inject(
            frame(
                b'{"type":"delegate/response","id":2,"result":{"status":"ok",'
                b'"value":{"type":"notification/delivered"}}}'
            )
        )
        text = '["tool broke","code-mode client returned an invalid tool result"]'
        body = WireRuntimeResponse(result=WireResultBody(cell, [WireInputText(text)], None))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(body))


# -- cancellation and admission limits (§8.5, §8.7) -------------------------------------------------


async def test_cancelling_a_wait_answers_h1_and_the_cell_keeps_running(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        source = (
            "text('a'); yield_control(); await new Promise((r) => setTimeout(r, 800)); text('b');"
        )
        cell = await client.execute(2, source)
        first = WireRuntimeResponse(yielded=WireYielded(cell, [WireInputText("a")]))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(first))
        client.send(OperationRequest(3, SessionWait(S1, WireWaitRequest(cell, 60_000))))
        await client.nothing(0.05)
        client.send(OperationCancel(3))
        assert await client.receive() == OperationResponse(
            3, WireError("code-mode request cancelled")
        )
        client.send(OperationCancel(3))  # a finished id: ignored
        client.send(OperationRequest(4, SessionWait(S1, WireWaitRequest(cell, 60_000))))
        body = WireRuntimeResponse(result=WireResultBody(cell, [WireInputText("b")], None))
        assert await client.receive() == ok(4, WaitCompleted(WireWaitOutcome(live_cell=body)))
        assert await client.receive() == CellClosed(S1, cell)


def missing(cell: str) -> WireRuntimeResponse:
    return WireRuntimeResponse(result=WireResultBody(cell, [], f"exec cell {cell} not found"))


async def test_a_wait_with_its_outcome_at_once_is_answered_though_its_cancel_came_with_it(
    provider: LocalSessionProvider,
) -> None:
    """A wait whose cell is missing, closed or completed unobserved has its outcome without
    waiting: read together with its cancel it is answered that outcome (as on the upstream host,
    both releases); a wait that has to wait is cancelled (H1) and the cell's output stays for the
    next one."""
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        cell = await client.execute(2, "text('x')")
        body = WireRuntimeResponse(result=WireResultBody(cell, [WireInputText("x")], None))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(body))
        assert await client.receive() == CellClosed(S1, cell)
        client.send(
            OperationRequest(3, SessionWait(S1, WireWaitRequest(cell, 60_000))),
            OperationCancel(3),
            OperationRequest(4, SessionWait(S1, WireWaitRequest("9", 60_000))),
            OperationCancel(4),
        )
        assert [await client.receive() for _ in range(2)] == [
            ok(3, WaitCompleted(WireWaitOutcome(missing_cell=missing(cell)))),
            ok(4, WaitCompleted(WireWaitOutcome(missing_cell=missing("9")))),
        ]
        done = await client.execute(8, "text('a'); yield_control(); text('b')", yield_ms=0)
        nothing = WireRuntimeResponse(yielded=WireYielded(done, []))
        assert await client.receive() == ExecuteInitialResponse(8, WireOk(nothing))
        await asyncio.sleep(0.3)  # the cell completes; its result waits for an observer
        client.send(
            OperationRequest(9, SessionWait(S1, WireWaitRequest(done, 60_000))),
            OperationCancel(9),
        )
        both = [WireInputText("a"), WireInputText("b")]
        buffered = WireRuntimeResponse(result=WireResultBody(done, list(both), None))
        assert await client.receive() == ok(9, WaitCompleted(WireWaitOutcome(live_cell=buffered)))
        assert await client.receive() == CellClosed(S1, done)
        source = "text('a'); yield_control(); await new Promise((r) => setTimeout(r, 300));"
        running = await client.execute(5, source + "text('b')")
        first = WireRuntimeResponse(yielded=WireYielded(running, [WireInputText("a")]))
        assert await client.receive() == ExecuteInitialResponse(5, WireOk(first))
        client.send(
            OperationRequest(6, SessionWait(S1, WireWaitRequest(running, 60_000))),
            OperationCancel(6),
        )
        assert await client.receive() == OperationResponse(
            6, WireError("code-mode request cancelled")
        )
        client.send(OperationRequest(7, SessionWait(S1, WireWaitRequest(running, 60_000))))
        last = WireRuntimeResponse(result=WireResultBody(running, [WireInputText("b")], None))
        assert await client.receive() == ok(7, WaitCompleted(WireWaitOutcome(live_cell=last)))
        assert await client.receive() == CellClosed(S1, running)


async def test_a_cancel_after_admission_is_ignored(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        cell = await client.execute(2, "await new Promise((r) => setTimeout(r, 100)); text('x');")
        client.send(OperationCancel(2))
        body = WireRuntimeResponse(result=WireResultBody(cell, [WireInputText("x")], None))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(body))
        assert await client.receive() == CellClosed(S1, cell)


async def test_too_many_active_cells_is_h3(provider: LocalSessionProvider) -> None:
    async with serving(provider, HostOptions(max_active_cells=1)) as served:
        client = served.client
        await client.handshake()
        await client.open()
        cell = await client.execute(2, "while (true) {}", yield_ms=50)
        assert isinstance(await client.receive(), ExecuteInitialResponse)
        body = WireExecuteRequest("call-2", [], "text('y')", None, None)
        client.send(OperationRequest(3, SessionExecute(S1, body)))
        assert await client.receive() == OperationResponse(
            3, WireError("code-mode host has too many active cells")
        )
        client.send(OperationRequest(4, SessionTerminate(S1, cell)))
        terminated = WireRuntimeResponse(terminated=WireTerminated(cell, []))
        assert await client.receive() == ok(4, WaitCompleted(WireWaitOutcome(live_cell=terminated)))
        assert await client.receive() == CellClosed(S1, cell)
        await client.execute(5, "text('y')")


async def test_too_many_in_flight_requests_is_h2(provider: LocalSessionProvider) -> None:
    async with serving(provider, HostOptions(max_in_flight_requests=1)) as served:
        client = served.client
        await client.handshake()
        await client.open()
        cell = await client.execute(2, "while (true) {}", yield_ms=600)
        # The execute is in flight until its initial response.
        client.send(OperationRequest(3, SessionOpen("session-2")))
        assert await client.receive() == OperationResponse(
            3, WireError("code-mode host has too many in-flight requests")
        )
        assert isinstance(await client.receive(), ExecuteInitialResponse)
        client.send(OperationRequest(4, SessionTerminate(S1, cell)))
        message = await client.receive()
        assert isinstance(message, OperationResponse) and message.id == 4
        assert await client.receive() == CellClosed(S1, cell)
        client.send(OperationRequest(3, SessionOpen("session-2")))  # a refused id stays taken
        assert await served.result() is False
        await client.expect_end()


async def test_shutdown_closes_cells_before_the_session(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        first = await client.execute(2, "while (true) {}", yield_ms=0)
        assert isinstance(await client.receive(), ExecuteInitialResponse)
        second = await client.execute(3, "await tools.block({});", tools=(BLOCK,), yield_ms=60_000)
        callback = await client.receive()
        assert isinstance(callback, DelegateRequestMessage)
        client.send(OperationRequest(4, SessionShutdown(S1)))
        messages = await client.receive_until(ok(4, SessionClosed(S1)))
        terminated = WireRuntimeResponse(terminated=WireTerminated(second, []))
        initial = ExecuteInitialResponse(3, WireOk(terminated))
        assert sorted(map(repr, messages)) == sorted(
            map(
                repr,
                [
                    DelegateCancel(callback.id),
                    initial,
                    CellClosed(S1, second),
                    CellClosed(S1, first),
                    ok(4, SessionClosed(S1)),
                ],
            )
        )
        # The callback was revoked and the initial response sent before the cell closed.
        assert messages.index(DelegateCancel(callback.id)) < messages.index(CellClosed(S1, second))
        assert messages.index(initial) < messages.index(CellClosed(S1, second))
        client.send(OperationRequest(5, SessionWait(S1, WireWaitRequest(first, 0))))
        assert await client.receive() == OperationResponse(
            5, WireError("unknown code-mode session session-1")
        )


async def test_a_shutdown_revokes_every_cells_callbacks_newest_first(
    provider: LocalSessionProvider,
) -> None:
    # As upstream (0.149.0 and 0.171.0, every run): across the session's cells, tool calls and
    # notifications alike, before any cell closes (upstream closes the cells in either order).
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        await client.execute(2, "await tools.block({});", tools=(BLOCK,), yield_ms=60_000)
        assert isinstance(await client.receive(), DelegateRequestMessage)
        source = "notify('n'); await tools.block({});"
        await client.execute(3, source, tools=(BLOCK,), yield_ms=60_000)
        requests = [await client.receive(), await client.receive()]
        assert [r.id for r in requests if isinstance(r, DelegateRequestMessage)] == [2, 3]
        client.send(OperationRequest(4, SessionShutdown(S1)))
        messages = await client.receive_until(ok(4, SessionClosed(S1)))
        cancels = [m for m in messages if isinstance(m, DelegateCancel)]
        assert cancels == [DelegateCancel(3), DelegateCancel(2), DelegateCancel(1)]
        first_close = next(i for i, m in enumerate(messages) if isinstance(m, CellClosed))
        assert messages.index(DelegateCancel(1)) < first_close


class HangingProvider(CodeModeSessionProvider):
    """Opening a session never finishes (until cancelled)."""

    def __init__(self) -> None:
        self.opening = asyncio.Event()
        self.cancelled = False

    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self, delegate: CodeModeSessionDelegate, limits: CodeModeSessionCellExecutionLimits
    ) -> CodeModeSession:
        self.opening.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


async def test_the_end_of_the_connection_cancels_in_flight_requests() -> None:
    provider = HangingProvider()
    async with serving(provider) as served:
        await served.client.handshake()
        served.client.send(OperationRequest(1, SessionOpen(S1)))
        async with asyncio.timeout(5):
            await provider.opening.wait()
        served.client.close()
        # Cleanup does not wait for the stuck open (SHUTDOWN_TIMEOUT would take 5 s).
        assert await served.result(1.0) is True
        assert provider.cancelled
        await served.client.expect_end()


# -- sessions ------------------------------------------------------------------------------------------


async def test_requests_pipelined_behind_an_open_wait_for_it(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        body = WireExecuteRequest("call-1", [], "text('x')", None, None)
        client.send(
            OperationRequest(1, SessionOpen(S1)),
            OperationRequest(2, SessionExecute(S1, body)),
        )
        assert await client.receive() == ok(1, SessionReady(S1))
        assert await client.receive() == ok(2, ExecutionStarted("1"))
        result = WireRuntimeResponse(result=WireResultBody("1", [WireInputText("x")], None))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(result))
        assert await client.receive() == CellClosed(S1, "1")


async def test_requests_pipelined_behind_a_failed_open_are_answered(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        body = WireExecuteRequest("call-1", [], "text('x')", None, None)
        limits = WireSessionCellExecutionLimits(max_heap_size_bytes=0)
        client.send(
            OperationRequest(1, SessionOpen(S1, limits)),
            OperationRequest(2, SessionExecute(S1, body)),
            OperationRequest(3, SessionShutdown(S1)),
        )
        messages = [await client.receive() for _ in range(3)]
        h5 = WireError("unknown code-mode session session-1")
        assert messages == [
            OperationResponse(
                1,
                WireError(
                    "invalid code-mode session execution limits: "
                    "max_heap_size_bytes must be greater than 0"
                ),
            ),
            OperationResponse(2, h5),
            OperationResponse(3, h5),
        ]
        # The connection is still up, and the id can be answered again with H11.
        client.send(OperationRequest(4, SessionOpen(S1)))
        assert await client.receive() == OperationResponse(
            4, WireError("code-mode session ID `session-1` was reused")
        )


async def test_limits_without_the_capability_are_h9(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake(hello(()), ready(()))
        limits = WireSessionCellExecutionLimits(max_yield_time_ms=250)
        client.send(OperationRequest(1, SessionOpen(S1, limits)))
        assert await client.receive() == OperationResponse(
            1,
            WireError(
                "invalid code-mode session execution limits: capability "
                "`session-cell-execution-resource-limits` was not negotiated"
            ),
        )
        await client.open(2)


async def test_session_ids_cannot_be_reused(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open(1)
        client.send(OperationRequest(2, SessionOpen(S1)))
        assert await client.receive() == OperationResponse(
            2, WireError("code-mode session ID `session-1` is already open")
        )
        client.send(OperationRequest(3, SessionShutdown(S1)))
        assert await client.receive() == ok(3, SessionClosed(S1))
        client.send(OperationRequest(4, SessionOpen(S1)))
        assert await client.receive() == OperationResponse(
            4, WireError("code-mode session ID `session-1` was reused")
        )


async def test_notification_failures_are_logged_and_the_cell_continues(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        cell = await client.execute(2, "notify('one'); notify('two'); text('done');")
        first = await client.receive()
        second = await client.receive()
        assert isinstance(first, DelegateRequestMessage)
        assert isinstance(second, DelegateRequestMessage)
        client.send(
            DelegateResponseMessage(first.id, WireError("nope")),
            DelegateResponseMessage(second.id, WireOk(ToolResult(1))),
        )
        body = WireRuntimeResponse(result=WireResultBody(cell, [WireInputText("done")], None))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(body))
    messages = [record.getMessage() for record in caplog.records]
    assert "failed to deliver code mode notification: nope" in messages
    assert (
        "failed to deliver code mode notification: "
        "code-mode client returned an invalid notification result"
    ) in messages


# -- the frame limit (§8.6) ------------------------------------------------------------------------


@pytest.mark.slow
async def test_an_oversize_initial_response_becomes_h8(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        # 12 Mi control characters pass the runtime's output limits (16 Mi characters) but are
        # 72 MiB as JSON (each is written \\u0001).
        cell = await client.execute(2, "text('\\u0001'.repeat(12 * 1024 * 1024));")
        message = await client.receive(30.0)
        assert isinstance(message, ExecuteInitialResponse) and message.id == 2
        assert isinstance(message.result, WireError)
        assert re.fullmatch(
            r"code-mode host response exceeds the IPC frame limit: "
            r"code-mode IPC frame length \d+ exceeds 67108864 bytes",
            message.result.message,
        ), message.result.message
        assert await client.receive() == CellClosed(S1, cell)
        await client.execute(3, "text('still up')")


@pytest.mark.slow
async def test_an_oversize_callback_rejects_with_j5(provider: LocalSessionProvider) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        source = (
            "try { await tools.echo('y'.repeat(64 * 1024 * 1024)); } catch (e) { text(String(e)); }"
        )
        cell = await client.execute(2, source, tools=(ECHO,))
        message = await client.receive(30.0)  # no delegate/request was written
        assert isinstance(message, ExecuteInitialResponse)
        assert isinstance(message.result, WireOk)
        body = message.result.value.body
        assert isinstance(body, WireResultBody) and body.error_text is None
        (item,) = body.content_items
        assert isinstance(item, WireInputText)
        # J5 as both upstream releases give it: the frame's own error text (docs/interop.md).
        assert re.fullmatch(r"code-mode IPC frame length \d+ exceeds 67108864 bytes", item.text), (
            item.text[:200]
        )
        assert await client.receive() == CellClosed(S1, cell)


async def test_a_cancel_while_the_session_opens_takes_effect(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        body = WireExecuteRequest("call-1", [], "text('x')", None, None)
        client.send(
            OperationRequest(1, SessionOpen(S1)),
            OperationRequest(2, SessionWait(S1, WireWaitRequest("1", 60_000))),
            OperationRequest(3, SessionExecute(S1, body)),
            OperationCancel(2),
            OperationCancel(3),
        )
        h1 = WireError("code-mode request cancelled")
        # The wait has its outcome at once (no cell "1" yet): that answers it, cancel or not,
        # as on the upstream host (docs/interop.md).
        assert [await client.receive() for _ in range(3)] == [
            ok(1, SessionReady(S1)),
            ok(2, WaitCompleted(WireWaitOutcome(missing_cell=missing("1")))),
            OperationResponse(3, h1),
        ]
        # The cancelled execute was never admitted: no cell was created for it.
        assert await client.execute(4, "text('y')") == "1"


# -- back-pressure: a client that does not read -----------------------------------------------------


@contextlib.asynccontextmanager
async def served_over_pipes(
    provider: CodeModeSessionProvider,
) -> AsyncIterator[tuple[int, Callable[[], Awaitable[FrameReader]], StreamTransport]]:
    """The host glue on real pipes: the client's write end, a function that starts reading what
    the host writes (until then the pipe fills, then the host's buffer), and the host's
    transport."""
    loop = asyncio.get_running_loop()
    to_host_read, to_host_write = os.pipe()
    from_host_read, from_host_write = os.pipe()
    pipe, flow = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(from_host_write, "wb", 0)
    )
    writer = asyncio.StreamWriter(pipe, flow, None, loop)
    transport = await pipe_transport(os.fdopen(to_host_read, "rb", 0), writer)
    reading: list[asyncio.ReadTransport] = []

    async def start_reading() -> FrameReader:
        reader = asyncio.StreamReader(limit=1 << 26)
        read_pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_host_read, "rb", 0)
        )
        reading.append(read_pipe)
        return FrameReader(reader)

    task = asyncio.create_task(serve_v1_connection(transport, provider))
    try:
        yield to_host_write, start_reading, transport
    finally:
        os.close(to_host_write)
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(10):
                await task
        if not task.done():  # pragma: no cover - only when a test already failed
            task.cancel()
        for read_pipe in reading:
            read_pipe.close()
        if not reading:
            os.close(from_host_read)


@pytest.mark.timeout(60)
async def test_callbacks_wait_while_the_client_does_not_read_and_those_given_up_are_never_written(
    provider: LocalSessionProvider,
) -> None:
    """Finding: every tool call went into the write buffer at once. A client that stopped reading
    (a blocked event loop) while its cells made large calls and ended (never awaiting them) grew
    the host by each call's frame: 20 cells of 40 MB calls took a stdio host to 794 MiB, and 128
    cells of a connection could hold 128 of them. Now a callback made while the client has not
    taken what was written waits in order, counted by the runtime; one whose cell ended is never
    written; the others go out as the client reads."""
    big = 4 << 20
    sources = [f'await tools.echo({{s: "a".repeat({big})}}); text("first")']
    sources += [f'tools.echo({{s: "b".repeat({big})}}); text("k")'] * 4
    sources.append("text((await tools.echo({n: 6})).n)")
    async with served_over_pipes(provider) as (to_host, start_reading, transport):
        requests = [OperationRequest(1, SessionOpen(S1))] + [
            OperationRequest(
                10 + i,
                SessionExecute(S1, WireExecuteRequest(f"c{i}", [ECHO], source, 30_000, None)),
            )
            for i, source in enumerate(sources)
        ]
        # The first call backs the host's writes up before the other cells start; those then
        # make their calls, and cells 2 to 5 end with theirs unanswered, while nothing is read.
        os.write(to_host, b"".join(frame(m) for m in [HELLO, *requests[:2]]))
        await eventually(transport.backlogged, 30)
        os.write(to_host, b"".join(frame(m) for m in requests[2:]))
        await eventually(lambda: live_cells(provider) == ["1", "6"], 30)
        assert transport.unsent() < big + (1 << 20), transport.unsent()
        from_host = await start_reading()
        invoked: list[str] = []
        results: dict[int, ExecuteInitialResponse] = {}
        async with asyncio.timeout(30):
            while len(results) < len(sources):
                message = CLIENT_READ.decode(await from_host.payload())
                if isinstance(message, DelegateRequestMessage):
                    assert isinstance(message.request, ToolInvoke), message
                    invocation = message.request.invocation
                    invoked.append(invocation.cell_id)
                    value = invocation.input if invocation.cell_id == "6" else {"ok": True}
                    os.write(
                        to_host,
                        frame(DelegateResponseMessage(message.id, WireOk(ToolResult(value)))),
                    )
                elif isinstance(message, DelegateCancel):
                    raise AssertionError(f"a cancel for a callback: {message} after {invoked}")
                elif isinstance(message, ExecuteInitialResponse):
                    results[message.id] = message
        assert invoked == ["1", "6"]
        texts = {}
        for request_id, response in results.items():
            assert isinstance(response.result, WireOk), response
            assert isinstance(response.result.value, WireRuntimeResponse), response
            texts[request_id] = [
                item.text
                for item in response.result.value.body.content_items
                if isinstance(item, WireInputText)
            ]
        assert texts == {10: ["first"], 11: ["k"], 12: ["k"], 13: ["k"], 14: ["k"], 15: ["6"]}
