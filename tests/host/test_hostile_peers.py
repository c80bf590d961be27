"""Hostile peers against the host's remote carriers: the WebSocket listener and the gRPC server.

Each test pins one finding of a sweep with real sockets on 127.0.0.1 against an in-process host
in front of the real embedded runtime: a bad peer gets a clear error or a prompt close, its
connection's work ends at once, and the host (its memory, its log, other connections) is unharmed.
The WebSocket peers are the independent raw client of ``tests/rawws.py``; the gRPC peers send raw
bytes on a ``grpc.aio`` channel.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import gc
import logging
from typing import Any

import grpc
import pytest
from grpc import aio

from codemode.grpc_stubs import v1_pb2_grpc
from codemode.host.grpc import GrpcHost
from codemode.host.websocket import WebSocketHost
from codemode.protocol.constants import MAX_WEBSOCKET_MESSAGE_BYTES
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.grpc.constants import SERVICE_PATH_PREFIX
from codemode.protocol.v1.codec import encode_frame
from codemode.protocol.v1.messages import (
    ClientToHost,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    OperationRequest,
    OperationResponse,
    SessionClosed,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    ToolInvoke,
    ToolResult,
    WireError,
    WireInputText,
    WireOk,
    WireRuntimeResponse,
)
from codemode.runtime import LocalSessionProvider
from codemode.runtime.engine import NodeEngine
from codemode.transports.websocket import WRITE_HIGH_WATER
from tests import rawws
from tests.host.test_grpc import (
    CHANNEL_OPTIONS,
    Stub,
    _execute,
    _open,
    _outcome,
    _served,
    _started,
    _texts,
)
from tests.host.test_websocket import (
    ECHO,
    FOREVER,
    HOST_LOG,
    S1,
    V1Socket,
    bulk_address,
    execute,
    listening,
    open_dual,
    open_session,
    open_single,
    result,
    started,
    still_serving,
)
from tests.polling import eventually, live_cells
from tests.rawws import Opcode

# -- WebSocket -------------------------------------------------------------------------------------


def _control_write_buffer(host: WebSocketHost) -> int:
    """Bytes the host's one served control socket has buffered for writing."""
    (transport,) = host._served.values()
    return transport.control.transport.get_write_buffer_size()


@pytest.mark.timeout(30)
async def test_a_ping_flood_from_a_peer_that_never_reads_cannot_grow_the_host(
    provider: LocalSessionProvider,
) -> None:
    """Finding: the library answers every ping with a pong as it reads; a peer that sends pings
    and never reads grew the host's write buffer without bound (about 25 MiB/s on loopback,
    until the keepalive gave up 40 s later). Now the host stops reading that socket once its
    writes back up, as it does for data messages."""
    async with listening(provider) as host:
        flooder = await open_single(host.url)
        try:
            pings = rawws.encode_frame(Opcode.PING, b"p" * 125) * 1000
            writer = flooder.ws.writer
            loop = asyncio.get_running_loop()
            peak = 0
            blocked = 0.0
            start = loop.time()
            # Until the flood was held up for half a second in all: soon when the host stops
            # reading it, never when it keeps reading (however loaded the machine is).
            while blocked <= 0.5 and loop.time() - start < 10:
                writer.write(pings)
                before = loop.time()
                try:
                    await asyncio.wait_for(writer.drain(), 0.1)
                except TimeoutError:
                    blocked += loop.time() - before
                peak = max(peak, _control_write_buffer(host))
            assert peak <= 4 * WRITE_HIGH_WATER, f"the host buffered {peak / 2**20:.1f} MiB"
            assert blocked > 0.5, "the host kept reading the flood"
            # Meanwhile another connection runs its cells as usual.
            other = await open_single(host.url)
            await open_session(other, 1)
            await other.send(execute(2, S1, "text('still here')"))
            cell = await started(other, 2)
            assert await other.receive() == result(2, cell, "still here")
            await other.close()
        finally:
            flooder.ws.abort()


async def _send_close(ws: rawws.RawWebSocket) -> None:
    await ws.send_close(1000)


async def _send_close_4000(ws: rawws.RawWebSocket) -> None:
    await ws.send_close(4000, "bye")


async def _send_reserved_opcode(ws: rawws.RawWebSocket) -> None:
    await ws.send_frame(0x3, b"x")


async def _send_oversize_header(ws: rawws.RawWebSocket) -> None:
    await ws.send_raw(
        rawws.encode_frame(Opcode.BINARY, declared_length=MAX_WEBSOCKET_MESSAGE_BYTES + 1)
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("send", "outcome"),
    [
        (_send_close, "outcome=clean"),
        (_send_close_4000, "message: WebSocket closed with code 4000: bye'"),
        (_send_reserved_opcode, "message: WebSocket closed with code 1002: invalid opcode'"),
        (_send_oversize_header, "WebSocket closed with code 1009"),
    ],
    ids=["close-1000", "close-4000", "protocol-error", "oversize"],
)
async def test_a_closing_handshake_ends_the_connection_without_waiting_for_tcp(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture, send: Any, outcome: str
) -> None:
    """Finding: after a close frame (or a frame the WebSocket layer refuses, which starts the
    closing handshake from our side) the connection went on until the peer closed TCP. A peer
    that then goes silent kept its connection, sessions and running cells until the next
    keepalive ping (20 s), or for ever with keepalive off. Now the connection ends at once."""
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    async with listening(provider, ping_interval=None) as host:
        silent = await open_single(host.url)
        try:
            await open_session(silent, 1)
            await silent.send(execute(2, S1, FOREVER, yield_ms=600_000))
            await started(silent, 2)
            assert host.active_cells() == 1
            await send(silent.ws)
            # The peer now neither reads nor closes its TCP connection.
            assert await eventually(lambda: host.active_cells() == 0, timeout=3.0) < 1.0
            await eventually(lambda: not host._served, timeout=3.0)
            await eventually(lambda: provider.live_cells == 0, timeout=3.0)
        finally:
            silent.ws.abort()
        closes = [
            record.getMessage()
            for record in caplog.records
            if "event=connection-close" in record.getMessage()
        ]
        assert len(closes) == 1 and outcome in closes[0], closes
        await still_serving(host.url)


@pytest.mark.timeout(30)
async def test_a_bulk_upgrade_that_fails_after_its_token_check_leaks_nothing(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding: the bulk token is checked (and taken) before the WebSocket layer validates the
    rest of the upgrade; when that failed (here: no ``Sec-WebSocket-Key``) the handler never ran
    and the host kept the refused connection, and through it the control's transport, for ever.
    Now nothing keeps it; the control connection ends when its pairing times out (§7.3)."""
    monkeypatch.setattr("codemode.host.v1.BULK_PAIRING_TIMEOUT", 0.3)
    async with listening(provider) as host:
        control, token = await open_dual(host.url)
        port = int(host.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                (
                    f"GET /bulk/{token} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                    "Sec-WebSocket-Version: 13\r\n\r\n"
                ).encode()
            )
            status = await asyncio.wait_for(reader.readline(), 5)
            assert status.startswith(b"HTTP/1.1 400 "), status
        finally:
            writer.close()
        await control.expect_closed(5.0)
        await eventually(lambda: not host._served)
        gc.collect()
        assert len(host._bulk) == 0, "the refused bulk connection is still held"
        await still_serving(host.url)


@pytest.mark.timeout(30)
async def test_a_bulk_socket_accepted_as_its_pairing_expires_is_closed_at_once(
    provider: LocalSessionProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Finding: the token is taken when the upgrade is read, and the socket is served only after
    the handshake's answer has gone out; a pairing that expired in between (§7.3: the control
    connection ends) met a bulk socket accepted anyway. The handler then failed on the expired
    pairing (`InvalidStateError`, logged as an error, the socket closed 1011), or, once the
    control socket had gone, attached the bulk socket to it and kept it open. Now the late bulk
    socket is closed at once and nothing fails."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("codemode.host.v1.BULK_PAIRING_TIMEOUT", 0.3)
    async with listening(provider) as host:
        serve_bulk = host._serve_bulk

        async def late(connection: Any, pairing: Any) -> None:
            # The answer of the upgrade is out; the handler starts after the pairing expired.
            await eventually(pairing.arrived.done)
            await serve_bulk(connection, pairing)

        monkeypatch.setattr(host, "_serve_bulk", late)
        control, token = await open_dual(host.url)
        bulk = V1Socket(await rawws.connect(bulk_address(host.url, token)))
        await control.expect_closed(5.0)
        closing = await bulk.expect_closed(5.0)
        assert closing is None or closing.close_code == 1000, closing
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        await eventually(lambda: not host._served)
        await still_serving(host.url)


def _engine_children() -> list[int]:
    """Live (not zombie) Node processes whose parent is this test's process: its engines."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"host.js" in command:
            found.append(int(entry))
    return found


def slow_engine_starts(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each engine start takes ``seconds`` longer once its child runs (a client can then be
    made to vanish in the middle of it)."""
    start = NodeEngine.start

    async def slow_start(engine: NodeEngine) -> None:
        await start(engine)
        await asyncio.sleep(seconds)

    monkeypatch.setattr(NodeEngine, "start", slow_start)


async def send_together(control: V1Socket, *messages: ClientToHost) -> None:
    """``messages`` in one write (one WebSocket message each): the host reads them together."""
    await control.ws.send_raw(
        b"".join(rawws.encode_frame(Opcode.BINARY, encode_frame(m)) for m in messages)
    )


@pytest.mark.timeout(60)
async def test_a_client_gone_while_its_cells_take_engines_leaves_no_engine_running(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding: a client that sent its first executes and vanished while their sessions' engines
    were starting left those engine processes running for ever, held by no session (seen on the
    CLI host: 7-11 idle Node processes after six such clients): the end of the connection
    cancelled the execute half-way through the engine's start. Now the start finishes and the
    engine is closed. Here each start takes 0.5 s longer once its child runs, so that the
    client is sure to vanish in the middle of it."""
    slow_engine_starts(monkeypatch, 0.5)
    async with listening(provider) as host:
        control = await open_single(host.url)
        # Each open and its execute in one write: the host reads them together, and the
        # execute, not the session's opening, takes the engine.
        for number in range(3):
            session = f"s{number}"
            await send_together(
                control,
                OperationRequest(10 + number, SessionOpen(session)),
                execute(20 + number, session, "while (true) {}", yield_ms=0),
            )
        await eventually(lambda: len(_engine_children()) >= 3)
        control.ws.abort()
        await eventually(lambda: not host._served)
        await eventually(lambda: not _engine_children(), timeout=10)
        await still_serving(host.url)


@pytest.mark.timeout(60)
async def test_a_shutdown_read_with_its_open_and_execute_while_the_engine_starts_leaves_none(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe (no finding): session/open, session/execute and session/shutdown of one session in
    one read, while the engine the execute takes is still starting: every request is answered
    (the execute with C9), the engine does not outlive the session, and the connection goes on."""
    slow_engine_starts(monkeypatch, 0.3)
    async with listening(provider) as host:
        control = await open_single(host.url)
        for number in range(3):
            session = f"s{number}"
            await send_together(
                control,
                OperationRequest(10 + number, SessionOpen(session)),
                execute(20 + number, session, "while (true) {}", yield_ms=0),
                OperationRequest(30 + number, SessionShutdown(session)),
            )
        answers: dict[int, object] = {}
        while len(answers) < 9:
            reply = await control.receive(10)
            assert isinstance(reply, OperationResponse), reply
            answers[reply.id] = reply.result
        for number in range(3):
            assert answers[10 + number] == WireOk(SessionReady(f"s{number}"))
            assert answers[20 + number] == WireError("code mode session is shutting down")
            assert answers[30 + number] == WireOk(SessionClosed(f"s{number}"))
        await eventually(lambda: len(_engine_children()) <= 1, timeout=10)
        await open_session(control, 40)


# -- gRPC ------------------------------------------------------------------------------------------

UNARY = (
    "CloseSession",
    "CompleteToolCall",
    "AcknowledgeNotification",
    "Wait",
    "YieldObservation",
    "CancelWait",
    "Terminate",
)
STREAMING = ("OpenSession", "SubscribeToToolCalls", "Execute")


#: How the refusal of undecodable request bytes begins (tonic's words; then the parser's text).
UNDECODABLE = "failed to decode Protobuf message: "


def _identity(data: bytes) -> bytes:
    return data


async def _raw_call(channel: aio.Channel, method: str, payload: bytes) -> aio.AioRpcError:
    """Send ``payload`` as the request bytes of ``method``; return the status it ends with."""
    path = SERVICE_PATH_PREFIX + method
    try:
        if method in STREAMING:
            call = channel.unary_stream(path, _identity, _identity)(payload, timeout=10)
            async for _ in call:
                raise AssertionError(f"{method} answered undecodable bytes")
        else:
            await channel.unary_unary(path, _identity, _identity)(payload, timeout=10)
    except aio.AioRpcError as error:
        return error
    raise AssertionError(f"{method} accepted undecodable bytes")


@pytest.mark.timeout(30)
async def test_undecodable_grpc_requests_end_internal_with_the_parser_text(
    grpc_host: GrpcHost, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: request bytes that are not a valid message (corrupt wire format, a string field
    with bad UTF-8) ended ``UNKNOWN`` with ``Unexpected <class 'google.protobuf.message.
    DecodeError'>`` and the host logged an error with a traceback for each one. Now the call ends
    ``INTERNAL`` (as the reference host's tonic answers) with the parser's text, nothing is
    logged above debug, and the session on the same channel goes on."""
    caplog.set_level(logging.DEBUG)
    channel = aio.insecure_channel(grpc_host.url.removeprefix("grpc://"), options=CHANNEL_OPTIONS)
    try:
        stub = v1_pb2_grpc.CodeModeHostStub(channel)
        lease = await _open(stub)
        for method in (*UNARY, *STREAMING):
            # Field 1 is a string (bad UTF-8), but OpenSession's is a message (corrupt).
            bad_field = "Wire format was corrupt" if method == "OpenSession" else "bad UTF-8"
            for payload, detail in (
                (b"\xff\xff", "Wire format was corrupt"),
                (b"\x0a\x02\xff\xfe", bad_field),
            ):
                error = await _raw_call(channel, method, payload)
                assert error.code() == grpc.StatusCode.INTERNAL, (method, error)
                message = error.details() or ""
                assert message.startswith(UNDECODABLE), (method, message)
                assert detail in message and "codex.code_mode.v1." in message, (method, message)
                assert "class" not in message, (method, message)
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not errors, [r.getMessage() for r in errors]
        call = _execute(stub, lease, "text('fine')")
        await _started(call)
        assert _texts(await _outcome(call)) == ["fine"]
        lease.call.cancel()
    finally:
        await channel.close()


@pytest.mark.timeout(30)
async def test_undecodable_grpc_requests_without_the_token_are_unauthenticated(
    provider: LocalSessionProvider,
) -> None:
    """The token is checked first: a refused peer learns nothing about what it sent."""
    host = GrpcHost(provider, "grpc://127.0.0.1:0", token="s3cret")
    await host.start()
    channel = aio.insecure_channel(host.url.removeprefix("grpc://"), options=CHANNEL_OPTIONS)
    try:
        for method in ("Wait", "Execute"):
            error = await _raw_call(channel, method, b"\xff\xff")
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (method, error)
        # With the token, the same bytes get the decoding error, and a valid request works.
        metadata = (("authorization", "Bearer s3cret"),)
        with pytest.raises(aio.AioRpcError) as raised:
            await channel.unary_unary(SERVICE_PATH_PREFIX + "Wait", _identity, _identity)(
                b"\xff\xff", metadata=metadata, timeout=10
            )
        assert raised.value.code() == grpc.StatusCode.INTERNAL, raised.value
        stub = v1_pb2_grpc.CodeModeHostStub(channel)
        opened = stub.OpenSession(pb.OpenSessionRequest(), metadata=metadata)
        first = await asyncio.wait_for(opened.read(), 30)
        assert isinstance(first, pb.SessionEvent) and first.WhichOneof("event") == "opened"
        opened.cancel()
    finally:
        await channel.close()
        await host.aclose()


@pytest.mark.timeout(60)
async def test_callbacks_wait_for_a_websocket_client_that_does_not_read(
    provider: LocalSessionProvider,
) -> None:
    """The WebSocket carrier's side of holding callbacks back (decision 0024; the stdio side is in
    tests/host/test_v1.py): while the client reads nothing, calls its cells make and give up on
    are never written, and the host's buffer holds no more than what had gone out before."""
    big = 16 << 20
    sources = [f'await tools.echo({{s: "a".repeat({big})}}); text("first")']
    sources += [f'tools.echo({{s: "b".repeat({big})}}); text("k")'] * 3
    sources.append("text((await tools.echo({n: 5})).n)")
    requests = [execute(10 + i, S1, source, [ECHO]) for i, source in enumerate(sources)]
    async with listening(provider) as host:
        control = await open_single(host.url)
        try:
            # The first call backs the host's writes up before the other cells start; those then
            # make their calls, and cells 2 to 4 end with theirs unanswered, while nothing is read.
            await send_together(control, OperationRequest(1, SessionOpen(S1)), requests[0])
            (served,) = host._served.values()
            await eventually(served.backlogged, 30)
            await send_together(control, *requests[1:])
            await eventually(lambda: live_cells(provider) == ["1", "5"], 30)
            assert _control_write_buffer(host) < big + (1 << 20), _control_write_buffer(host)
            invoked: list[str] = []
            answered: dict[int, list[str]] = {}
            async with asyncio.timeout(30):
                while len(answered) < len(sources):
                    message = await control.receive(30)
                    if isinstance(message, DelegateRequestMessage):
                        assert isinstance(message.request, ToolInvoke), message
                        invocation = message.request.invocation
                        invoked.append(invocation.cell_id)
                        value = invocation.input if invocation.cell_id == "5" else {}
                        await control.send(
                            DelegateResponseMessage(message.id, WireOk(ToolResult(value)))
                        )
                    elif isinstance(message, ExecuteInitialResponse):
                        assert isinstance(message.result, WireOk), message
                        assert isinstance(message.result.value, WireRuntimeResponse), message
                        answered[message.id] = [
                            item.text
                            for item in message.result.value.body.content_items
                            if isinstance(item, WireInputText)
                        ]
                    else:
                        assert not isinstance(message, DelegateCancel), message
            assert invoked == ["1", "5"]
            assert answered == {10: ["first"], 11: ["k"], 12: ["k"], 13: ["k"], 14: ["5"]}
        finally:
            control.ws.abort()


@pytest.mark.timeout(60)
async def test_sessions_that_run_no_cell_give_their_engines_back() -> None:
    """Finding: a session opened and never used kept the engine taken for its first cell for
    ever (the idle timeout was armed only when a cell closed): a client that opened sessions and
    ran nothing held an engine process (some 50 MB) per session up to the host's bound on
    engines. Now such an engine is given back after the idle timeout, as any idle session's."""
    async with (
        LocalSessionProvider(warm_engines=0, idle_engine_timeout=0.3) as provider,
        _served(GrpcHost(provider, "grpc://127.0.0.1:0")) as stub,
    ):
        leases = [await _open(stub) for _ in range(3)]
        await eventually(lambda: len(_engine_children()) == 3, timeout=30)
        await eventually(lambda: not _engine_children(), timeout=10)
        assert len(provider._sessions) == 3  # the sessions stay open
        call = _execute(stub, leases[0], "text('still here')")
        await _started(call)
        assert _texts(await _outcome(call)) == ["still here"]


@pytest.mark.timeout(60)
async def test_an_execute_dropped_while_its_cell_terminates_logs_no_error(
    grpc_host: GrpcHost, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: an ``Execute`` a client dropped while a ``Terminate`` of its cell was under way
    (here the cell's unacknowledged notification holds the termination for its grace) made the
    host log ``Exception in callback ... exec cell 1 is already terminating`` with a traceback,
    once per such drop: a client could fill the host's log. The drop now joins the termination."""
    caplog.set_level(logging.WARNING)
    channel = aio.insecure_channel(grpc_host.url.removeprefix("grpc://"), options=CHANNEL_OPTIONS)
    try:
        stub: Stub = v1_pb2_grpc.CodeModeHostStub(channel)
        lease = await _open(stub)
        for _ in range(3):
            call = _execute(stub, lease, "notify('n'); while (true) {}", yield_time_ms=60_000)
            started = await _started(call)
            await lease.until("notification")
            terminate = asyncio.ensure_future(
                stub.Terminate(
                    pb.TerminateRequest(session_id=lease.session_id, cell_id=started.cell_id)
                )
            )
            await asyncio.sleep(0.02)
            call.cancel()
            outcome = await asyncio.wait_for(terminate, 30)
            assert outcome.live_cell.HasField("terminated"), outcome
            await lease.until("cell_closed")
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not errors, [r.getMessage() for r in errors]
        call = _execute(stub, lease, "text('fine')")
        await _started(call)
        assert _texts(await _outcome(call)) == ["fine"]
    finally:
        await channel.close()
