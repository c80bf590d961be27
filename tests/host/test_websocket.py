"""The WebSocket carrier of Protocol V1 (``protocol-v1.md`` §6.4, §7), host side.

Every test talks to a real listener on 127.0.0.1 with the independent RFC 6455 client of
``tests/rawws.py`` (never the ``websockets`` library): an in-process :class:`WebSocketHost` in
front of the real embedded runtime, or the ``codemode host`` CLI as a child process where the
test is about the process (its memory, its signals, its log lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from websockets.protocol import State

from codemode.host.websocket import WebSocketAddress, WebSocketHost
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    MAX_WEBSOCKET_MESSAGE_BYTES,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.v1.codec import MessageDecoder, decode_framed, encode_frame
from codemode.protocol.v1.handshake import client_hello
from codemode.protocol.v1.messages import (
    CellClosed,
    ClientToHost,
    ConnectionReady,
    DelegateRequestMessage,
    DelegateResponse,
    DelegateResponseMessage,
    ExecuteInitialResponse,
    ExecutionStarted,
    HostToClient,
    NotificationDelivered,
    NotificationSend,
    OperationRequest,
    OperationResponse,
    SessionClosed,
    SessionExecute,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    SessionWait,
    ToolInvoke,
    ToolResult,
    WireError,
    WireExecuteRequest,
    WireInputText,
    WireOk,
    WireResultBody,
    WireRuntimeResponse,
    WireToolDefinition,
    WireToolName,
    WireWaitRequest,
    WireYielded,
)
from codemode.protocol.v1.texts import (
    BULK_NOT_ESTABLISHED,
    CLIENT_SENT_TEXT,
    HOST_SHUTTING_DOWN,
    client_wrong_lane,
)
from codemode.runtime import LocalSessionProvider
from tests import rawws
from tests.polling import eventually
from tests.rawws import HandshakeRejected, Opcode, RawWebSocket
from tests.wire import FrameReader, frame

HOST_MESSAGES = MessageDecoder[HostToClient](HostToClient)
LIMITS = SESSION_RESOURCE_LIMITS_CAPABILITY
SINGLE_READY = ConnectionReady(1, (LIMITS,))
S1, S2 = "session-1", "session-2"
ECHO = WireToolDefinition("echo", WireToolName("echo", None), "", "function", None, None)
BIG = WireToolDefinition("big", WireToolName("big", None), "", "function", None, None)
TOKEN = "s3cret-token"
FOREVER = "await new Promise((resolve) => setTimeout(resolve, 600000)); text('never');"

HOST_LOG = "codemode.host"


# -- a V1 peer over the raw client ----------------------------------------------------------------


class V1Socket:
    """One raw WebSocket that speaks V1 frames: one frame per binary message."""

    def __init__(self, ws: RawWebSocket) -> None:
        self.ws = ws

    async def send(self, *messages: ClientToHost, fragments: int = 1) -> None:
        for message in messages:
            await self.ws.send_binary(encode_frame(message), fragments=fragments)

    async def receive(self, timeout: float = 5.0) -> HostToClient:
        message = await self.ws.recv_message(timeout)
        assert message is not None, "the host dropped the TCP connection"
        assert message.opcode == Opcode.BINARY, message
        return decode_framed(message.payload, HOST_MESSAGES)

    async def receive_many(self, count: int, timeout: float = 5.0) -> list[HostToClient]:
        return [await self.receive(timeout) for _ in range(count)]

    async def nothing(self, delay: float = 0.1) -> None:
        """Nothing arrives (and the socket is not closed) for ``delay`` seconds."""
        try:
            message = await self.ws.recv_message(delay)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected {message!r}")

    async def expect_closed(self, timeout: float = 5.0) -> rawws.Frame | None:
        """The host closes this socket without sending any more messages."""
        message = await self.ws.recv_message(timeout)
        assert message is None or message.opcode == Opcode.CLOSE, message
        return message

    async def close(self) -> None:
        await self.ws.close()


def bearer(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("Authorization", f"Bearer {token}")]


def bulk_address(url: str, token: str) -> str:
    """``<control path without trailing />/bulk/<token>``, built by hand (§7.3)."""
    return f"{url.rstrip('/')}/bulk/{token}"


async def open_single(url: str, headers: Iterable[tuple[str, str]] = ()) -> V1Socket:
    """A single-socket connection whose handshake completed."""
    control = V1Socket(await rawws.connect(url, headers))
    await control.send(client_hello())
    assert await control.receive() == SINGLE_READY
    return control


async def open_dual(url: str, headers: Iterable[tuple[str, str]] = ()) -> tuple[V1Socket, str]:
    """A control socket whose handshake granted the bulk socket; returns it and the token."""
    control = V1Socket(await rawws.connect(url, headers))
    await control.send(client_hello(dual_websocket=True))
    ready = await control.receive()
    assert isinstance(ready, ConnectionReady), ready
    assert ready.selected_version == 1
    assert ready.capabilities == (DUAL_WEBSOCKET_CAPABILITY, LIMITS)
    assert isinstance(ready.bulk_connection_token, str)
    assert ready.bulk_connection_token
    return control, ready.bulk_connection_token


async def open_bulk(url: str, token: str, headers: Iterable[tuple[str, str]] = ()) -> V1Socket:
    return V1Socket(await rawws.connect(bulk_address(url, token), headers))


async def open_pair(
    url: str, headers: Sequence[tuple[str, str]] = ()
) -> tuple[V1Socket, V1Socket, str]:
    control, token = await open_dual(url, headers)
    return control, await open_bulk(url, token, headers), token


async def refused(url: str, headers: Iterable[tuple[str, str]] = ()) -> HandshakeRejected:
    """The upgrade to ``url`` is answered with an HTTP error (returned)."""
    try:
        ws = await rawws.connect(url, headers)
    except HandshakeRejected as rejected:
        return rejected
    await ws.close()
    raise AssertionError(f"{url} was accepted")


def ok(request_id: int, value: Any) -> OperationResponse:
    return OperationResponse(request_id, WireOk(value))


def result(request_id: int, cell_id: str, *texts: str) -> ExecuteInitialResponse:
    items: list[Any] = [WireInputText(text) for text in texts]
    return ExecuteInitialResponse(
        request_id, WireOk(WireRuntimeResponse(result=WireResultBody(cell_id, items, None)))
    )


def execute(
    request_id: int,
    session_id: str,
    source: str,
    tools: Sequence[WireToolDefinition] = (),
    yield_ms: int = 10_000,
) -> OperationRequest:
    body = WireExecuteRequest(f"call-{request_id}", list(tools), source, yield_ms, None)
    return OperationRequest(request_id, SessionExecute(session_id, body))


async def open_session(control: V1Socket, request_id: int, session_id: str = S1) -> None:
    await control.send(OperationRequest(request_id, SessionOpen(session_id)))
    assert await control.receive() == ok(request_id, SessionReady(session_id))


async def started(control: V1Socket, request_id: int) -> str:
    reply = await control.receive()
    assert isinstance(reply, OperationResponse) and reply.id == request_id, reply
    assert isinstance(reply.result, WireOk), reply
    assert isinstance(reply.result.value, ExecutionStarted), reply
    return reply.result.value.cell_id


async def still_serving(url: str, token: str | None = None) -> None:
    """The listener accepts a fresh connection and completes its handshake."""
    control = await open_single(url, bearer(token))
    await control.close()


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == HOST_LOG]


# -- fixtures --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def listening(
    provider: LocalSessionProvider, path: str = "/", **options: Any
) -> AsyncIterator[WebSocketHost]:
    host = WebSocketHost(provider, WebSocketAddress("127.0.0.1", 0, path), **options)
    await host.start()
    try:
        yield host
    finally:
        async with asyncio.timeout(15):
            await host.aclose()


# -- 1. interop: whole conversations ----------------------------------------------------------------


async def test_a_single_socket_conversation(provider: LocalSessionProvider) -> None:
    async with listening(provider) as host:
        assert re.fullmatch(r"ws://127\.0\.0\.1:\d+", host.url), host.url
        control = await open_single(host.url)
        await open_session(control, 1)
        await control.send(execute(2, S1, 'text("hi")'))
        cell = await started(control, 2)
        assert await control.receive() == result(2, cell, "hi")
        await control.send(OperationRequest(3, SessionShutdown(S1)))
        assert await control.receive_many(2) == [CellClosed(S1, cell), ok(3, SessionClosed(S1))]
        await control.nothing()
        await control.close()
        await eventually(lambda: provider.live_cells == 0)


async def test_fragmented_messages_and_every_length_form_are_accepted(
    provider: LocalSessionProvider,
) -> None:
    """A message in several frames is one V1 frame; 7-, 16- and 64-bit lengths both ways."""
    async with listening(provider) as host:
        control = await open_single(host.url)
        await control.send(OperationRequest(1, SessionOpen(S1)), fragments=2)
        assert await control.receive() == ok(1, SessionReady(S1))
        # (padding of the source, fragments, length of the text the cell writes back)
        cases = ((2, 10, 3, 10), (3, 1_000, 2, 1_000), (4, 100_000, 1, 70_000))
        for request_id, padding, fragments, size in cases:
            source = f"// {'x' * padding}\ntext('y'.repeat({size}));"
            await control.send(execute(request_id, S1, source), fragments=fragments)
            cell = await started(control, request_id)
            assert await control.receive_many(2) == [
                result(request_id, cell, "y" * size),
                CellClosed(S1, cell),
            ]
        # Pings from the client are answered; the connection goes on.
        await control.ws.ping(b"are you there")
        pong = await control.ws.recv_frame()
        assert pong == rawws.Frame(True, Opcode.PONG, b"are you there")
        await control.close()


def test_the_raw_client_matches_the_rfc_examples() -> None:
    """RFC 6455 §1.3 and §5.7, so that the raw client is checked on its own."""
    assert rawws.accept_for("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    masked = rawws.encode_frame(Opcode.TEXT, b"Hello", mask_key=bytes.fromhex("37fa213d"))
    assert masked == bytes.fromhex("818537fa213d7f9f4d5158")
    assert rawws.encode_frame(Opcode.TEXT, b"Hel", fin=False, masked=False) == b"\x01\x03Hel"
    assert rawws.encode_frame(Opcode.PING, b"Hello", masked=False) == b"\x89\x05Hello"
    assert rawws.encode_frame(Opcode.BINARY, bytes(256), masked=False)[:4] == b"\x82\x7e\x01\x00"
    header = rawws.encode_frame(Opcode.BINARY, bytes(65536), masked=False)[:10]
    assert header == b"\x82\x7f\x00\x00\x00\x00\x00\x01\x00\x00"
    assert (
        rawws.mask_payload(rawws.mask_payload(b"abcdefg", b"\x01\x02\x03\x04"), b"\x01\x02\x03\x04")
        == b"abcdefg"
    )


@pytest.mark.parametrize("path", ["/", "/codemode/"])
async def test_a_dual_socket_conversation(provider: LocalSessionProvider, path: str) -> None:
    async with listening(provider, path) as host:
        control, bulk, _ = await open_pair(host.url)
        await open_session(control, 1)
        source = (
            "const r = await tools.echo({value: 'ping'}); notify('note'); "
            "text(r.value); text(JSON.stringify(r.more));"
        )
        await control.send(execute(2, S1, source, [ECHO]))
        cell = await started(control, 2)
        invoke = await bulk.receive()
        assert isinstance(invoke, DelegateRequestMessage), invoke
        assert invoke.session_id == S1
        assert isinstance(invoke.request, ToolInvoke), invoke
        assert invoke.request.invocation.cell_id == cell
        assert invoke.request.invocation.tool_name == WireToolName("echo", None)
        assert invoke.request.invocation.input == {"value": "ping"}
        await control.nothing()  # the tool call travels on bulk only
        answer = ToolResult({"value": "pong", "more": [1, 2]})
        await bulk.send(DelegateResponseMessage(invoke.id, WireOk(answer)))
        # The notification and its answer travel on control; the cell closes after its answer.
        others: list[HostToClient] = []
        notes: list[NotificationSend] = []
        while not others or others[-1] != CellClosed(S1, cell):
            message = await control.receive()
            if isinstance(message, DelegateRequestMessage):
                assert isinstance(message.request, NotificationSend), message
                notes.append(message.request)
                delivered = WireOk[DelegateResponse](NotificationDelivered())
                await control.send(DelegateResponseMessage(message.id, delivered))
            else:
                others.append(message)
        assert [(note.cell_id, note.text) for note in notes] == [(cell, "note")]
        assert others == [result(2, cell, "pong", "[1,2]"), CellClosed(S1, cell)]
        await bulk.nothing()
        await control.send(OperationRequest(3, SessionShutdown(S1)))
        assert await control.receive() == ok(3, SessionClosed(S1))
        await control.close()
        # Closing control ends the connection: the host closes bulk too.
        await bulk.expect_closed()


# -- 2. refusals, each followed by a fresh connection -----------------------------------------------


async def test_plain_http_readyz_and_unknown_paths(provider: LocalSessionProvider) -> None:
    async with listening(provider, "/codemode") as host:
        ready = await rawws.http_get(host.url, "/readyz")
        assert (ready.status, ready.body) == (200, b"ok\n")
        for path in ("/", "/codemode", "/codemode/bulk/abc", "/nope", "/readyz/x"):
            response = await rawws.http_get(host.url, path)
            assert response.status == 404, (path, response)
        await still_serving(host.url)


@pytest.mark.parametrize("where", ["control", "bulk"])
async def test_an_origin_header_is_refused_with_403(
    provider: LocalSessionProvider, where: str
) -> None:
    async with listening(provider) as host:
        origin = [("Origin", "http://127.0.0.1:8000")]
        if where == "control":
            rejected = await refused(host.url, origin)
            assert rejected.status == 403
        else:
            control, token = await open_dual(host.url)
            assert (await refused(bulk_address(host.url, token), origin)).status == 403
            # The refusal did not use the bulk token up.
            bulk = await open_bulk(host.url, token)
            await open_session(control, 1)
            await control.close()
            await bulk.expect_closed()
        await still_serving(host.url)


async def test_the_bearer_token_is_required_on_both_sockets(
    provider: LocalSessionProvider,
) -> None:
    async with listening(provider, token=TOKEN) as host:
        for headers in (
            [],
            bearer("wrong"),
            bearer(TOKEN + "x"),
            [("Authorization", TOKEN)],
            [("Authorization", f"Basic {TOKEN}")],
        ):
            assert (await refused(host.url, headers)).status == 401, headers
        await still_serving(host.url, TOKEN)
        # The right token works on both sockets; a bulk socket without it is refused and does
        # not use up the bulk token.
        control, token = await open_dual(host.url, bearer(TOKEN))
        assert (await refused(bulk_address(host.url, token))).status == 401
        assert (await refused(bulk_address(host.url, token), bearer("wrong"))).status == 401
        bulk = await open_bulk(host.url, token, bearer(TOKEN))
        await open_session(control, 1)
        await control.send(execute(2, S1, "text((await tools.echo({v: 7})).v)", [ECHO]))
        cell = await started(control, 2)
        invoke = await bulk.receive()
        assert isinstance(invoke, DelegateRequestMessage), invoke
        await bulk.send(DelegateResponseMessage(invoke.id, WireOk(ToolResult({"v": 7}))))
        assert await control.receive() == result(2, cell, "7")
        await control.close()
        await bulk.expect_closed()
        # /readyz needs no token.
        assert (await rawws.http_get(host.url, "/readyz")).status == 200
        await still_serving(host.url, TOKEN)


@pytest.mark.timeout(30)
async def test_the_bearer_scheme_is_taken_in_any_case(provider: LocalSessionProvider) -> None:
    # RFC 9110 §11.1: the authentication scheme is case-insensitive; the token is exact.
    async with listening(provider, token=TOKEN) as host:
        for scheme in ("bearer", "BEARER"):
            control = await open_single(host.url, [("Authorization", f"{scheme} {TOKEN}")])
            await control.close()
            wrong = [("Authorization", f"{scheme} {TOKEN.upper()}")]
            assert (await refused(host.url, wrong)).status == 401
        control, token = await open_dual(host.url, [("Authorization", f"bearer {TOKEN}")])
        bulk = await open_bulk(host.url, token, [("Authorization", f"BEARER {TOKEN}")])
        await open_session(control, 1)
        await control.close()
        await bulk.expect_closed()


async def test_an_unknown_bulk_token_is_refused_with_404(provider: LocalSessionProvider) -> None:
    async with listening(provider) as host:
        control, token = await open_dual(host.url)
        for wrong in ("unknown", token + "x", token[:-1], ""):
            assert (await refused(bulk_address(host.url, wrong))).status == 404, wrong
        # The right token still pairs after the refusals.
        bulk = await open_bulk(host.url, token)
        await open_session(control, 1)
        await control.close()
        await bulk.expect_closed()
        await still_serving(host.url)


async def test_a_reused_bulk_token_is_refused_with_404(provider: LocalSessionProvider) -> None:
    async with listening(provider) as host:
        control, bulk, token = await open_pair(host.url)
        assert (await refused(bulk_address(host.url, token))).status == 404
        # The pair that used it goes on working.
        await open_session(control, 1)
        await control.send(execute(2, S1, "text((await tools.echo({v: 'b'})).v)", [ECHO]))
        cell = await started(control, 2)
        invoke = await bulk.receive()
        assert isinstance(invoke, DelegateRequestMessage), invoke
        await bulk.send(DelegateResponseMessage(invoke.id, WireOk(ToolResult({"v": "b"}))))
        assert await control.receive() == result(2, cell, "b")
        await control.close()
        await bulk.expect_closed()
        # ... and once it ended, its token is still no good.
        assert (await refused(bulk_address(host.url, token))).status == 404
        await still_serving(host.url)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("end", ["close", "abort"])
async def test_a_bulk_token_expires_with_its_control_socket(
    provider: LocalSessionProvider, end: str
) -> None:
    # §7.3: an expired token is 404, and it expires when its control socket ends, not at the
    # pairing timeout (it used to pair for up to 10 s, and the bulk socket was then closed).
    async with listening(provider) as host:
        control, token = await open_dual(host.url)
        (transport,) = host._served.values()
        if end == "close":
            await control.close()
        else:
            control.ws.abort()
        await eventually(lambda: transport.control.state is not State.OPEN)
        assert (await refused(bulk_address(host.url, token))).status == 404
        await eventually(lambda: not host._pairings)  # forgotten, not held until the timeout
        await still_serving(host.url)


async def test_a_bulk_socket_that_never_comes_ends_the_connection(
    provider: LocalSessionProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    monkeypatch.setattr("codemode.host.v1.BULK_PAIRING_TIMEOUT", 0.3)
    async with listening(provider) as host:
        control, token = await open_dual(host.url)
        await control.expect_closed(5.0)
        assert BULK_NOT_ESTABLISHED in logged(caplog)
        # The expired token is forgotten.
        assert (await refused(bulk_address(host.url, token))).status == 404
        await still_serving(host.url)


@pytest.mark.parametrize("where", ["single", "dual-control", "dual-bulk"])
async def test_a_text_message_ends_the_connection(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    async with listening(provider) as host:
        if where == "single":
            control = await open_single(host.url)
            sockets = [control]
            target = control
        else:
            control, bulk, _ = await open_pair(host.url)
            sockets = [control, bulk]
            target = control if where == "dual-control" else bulk
        await open_session(control, 1)
        await control.send(execute(2, S1, FOREVER, yield_ms=600_000))
        await started(control, 2)
        await target.ws.send_text('{"type":"operation/cancel","id":2}')
        for socket in sockets:
            await socket.expect_closed()
        assert CLIENT_SENT_TEXT in logged(caplog)
        await eventually(lambda: provider.live_cells == 0)
        await still_serving(host.url)


async def test_an_oversize_message_ends_the_connection(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    async with listening(provider) as host:
        control = await open_single(host.url)
        await open_session(control, 1)
        # Only the header and a little of the payload: the length alone is refused.
        header = rawws.encode_frame(
            Opcode.BINARY, b"", declared_length=MAX_WEBSOCKET_MESSAGE_BYTES + 1, mask_key=b"abcd"
        )
        assert MAX_WEBSOCKET_MESSAGE_BYTES + 1 == 67_108_869
        await control.ws.send_raw(header + b"\x00" * 1024)
        closing = await control.expect_closed()
        assert closing is None or closing.close_code == 1009, closing
        await eventually(lambda: host.active_cells() == 0)
        await still_serving(host.url)


@pytest.mark.parametrize(
    "data",
    [
        frame(OperationRequest(9, SessionShutdown(S1))) * 2,
        frame(OperationRequest(9, SessionShutdown(S1)))[:-1],
        b"",
        b"\x01\x00",
        frame(b'{"type":"operation/cancel","id":1}') + b" ",
    ],
    ids=["two-frames", "truncated", "empty", "short-prefix", "trailing-byte"],
)
async def test_a_message_that_is_not_exactly_one_frame_ends_the_connection(
    provider: LocalSessionProvider, data: bytes
) -> None:
    async with listening(provider) as host:
        control = await open_single(host.url)
        await open_session(control, 1)
        await control.ws.send_binary(data)
        await control.expect_closed()
        await still_serving(host.url)


async def test_a_request_on_the_bulk_socket_ends_both_sockets(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    async with listening(provider) as host:
        control, bulk, _ = await open_pair(host.url)
        await open_session(control, 1)
        await bulk.send(OperationRequest(2, SessionOpen(S2)))
        await bulk.expect_closed()
        await control.expect_closed()
        assert client_wrong_lane("operation/request", "bulk") in logged(caplog)
        await still_serving(host.url)


async def test_a_tool_result_on_the_control_socket_ends_both_sockets(
    provider: LocalSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    async with listening(provider) as host:
        control, bulk, _ = await open_pair(host.url)
        await open_session(control, 1)
        await control.send(execute(2, S1, "await tools.echo({}); text('x');", [ECHO]))
        await started(control, 2)
        invoke = await bulk.receive()
        assert isinstance(invoke, DelegateRequestMessage), invoke
        await control.send(DelegateResponseMessage(invoke.id, WireOk(ToolResult({}))))
        await control.expect_closed()
        await bulk.expect_closed()
        assert client_wrong_lane("delegate/response", "control") in logged(caplog)
        await eventually(lambda: provider.live_cells == 0)
        await still_serving(host.url)


async def test_connections_past_the_limit_are_refused_with_503(
    provider: LocalSessionProvider,
) -> None:
    async with listening(provider, max_connections=1) as host:
        # A dual pair is one connection: its bulk socket is not refused.
        control, bulk, _ = await open_pair(host.url)
        rejected = await refused(host.url)
        assert rejected.status == 503
        await control.close()
        await bulk.expect_closed()

        async def accepted() -> bool:
            try:
                await still_serving(host.url)
            except HandshakeRejected as error:
                status = error.status
            else:
                return True
            assert status == 503
            return False

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while not await accepted():
            assert loop.time() < deadline, "the slot was never freed"
            await asyncio.sleep(0.02)


# -- 3. control before bulk --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_large_tool_result_in_flight_does_not_hold_up_control(
    provider: LocalSessionProvider,
) -> None:
    """While a 32 MiB tool result is half written on the bulk socket, another session's execute
    is admitted and answered on the control socket: the answers arrive while the bulk frame is
    still incomplete (ordering, not timing)."""
    async with listening(provider) as host:
        control, bulk, _ = await open_pair(host.url)
        await open_session(control, 1, "a")
        await open_session(control, 2, "b")
        await control.send(
            execute(3, "a", "const r = await tools.big({}); text(String(r.length));", [BIG])
        )
        cell_a = await started(control, 3)
        invoke = await bulk.receive()
        assert isinstance(invoke, DelegateRequestMessage), invoke
        size = 32 << 20
        payload = (
            b'{"type":"delegate/response","id":%d,"result":{"status":"ok","value":'
            b'{"type":"tool/result","result":"' % invoke.id + b"x" * size + b'"}}}'
        )
        message = len(payload).to_bytes(4, "little") + payload
        held = await bulk.ws.send_partial(Opcode.BINARY, message, sent=len(message) // 2)
        assert held.sent > 16 << 20  # far more than the kernel buffers: the host is reading it

        await control.send(execute(4, "b", "text('quick');"))
        cell_b = await started(control, 4)
        assert await control.receive_many(2) == [
            result(4, cell_b, "quick"),
            CellClosed("b", cell_b),
        ]
        assert not held.finished  # all of it arrived while the bulk frame was incomplete

        await held.finish()
        assert await control.receive_many(2, timeout=30) == [
            result(3, cell_a, str(size)),
            CellClosed("a", cell_a),
        ]
        await control.close()
        await bulk.expect_closed()


# -- 5. keepalive ------------------------------------------------------------------------------


async def test_keepalive_fails_a_silent_socket_and_keeps_a_responsive_one(
    provider: LocalSessionProvider,
) -> None:
    # A pong may take a while on a loaded machine: ``live`` must not be failed for one (the
    # silent socket is failed within 0.2 + 0.8 s all the same, well before ``live``'s yield).
    async with listening(provider, ping_interval=0.2, ping_timeout=0.8) as host:
        # ``live`` keeps reading (and answering pings) while its cell yields after 2 s.
        live = await open_single(host.url)
        await open_session(live, 1)
        await live.send(execute(2, S1, FOREVER, yield_ms=2_000))
        live_cell = await started(live, 2)
        silent = await open_single(host.url)
        try:
            await open_session(silent, 1)
            await silent.send(execute(2, S1, FOREVER, yield_ms=600_000))
            await started(silent, 2)
            assert host.active_cells() == 2
            # From now on ``silent`` reads nothing (for 2 s): its pings go unanswered.
            assert await live.receive(timeout=10) == ExecuteInitialResponse(
                2, WireOk(WireRuntimeResponse(yielded=WireYielded(live_cell, [])))
            )
            # The host failed the silent socket: its close frame is waiting to be read.
            closing = await silent.ws.wait_closed()
            assert closing is not None, "the host dropped the TCP connection without a close"
            assert (closing.close_code, closing.close_reason) == (1011, "keepalive ping timeout")
        finally:
            silent.ws.abort()
        # Once the silent peer's TCP connection is gone, its connection and cell end at once.
        assert await eventually(lambda: host.active_cells() == 1, timeout=2.0) < 1.0
        await live.close()
        await eventually(lambda: host.active_cells() == 0)


class StillConnected(AssertionError):
    """The silent connection outlived the keepalive bound."""


async def test_a_client_that_stops_answering_pings_is_dropped_within_a_second(
    provider: LocalSessionProvider,
) -> None:
    async with listening(provider, ping_interval=0.2, ping_timeout=0.2) as host:
        silent = await open_single(host.url)
        try:
            await open_session(silent, 1)
            await silent.send(execute(2, S1, FOREVER, yield_ms=600_000))
            await started(silent, 2)
            assert host.active_cells() == 1
            # From now on ``silent`` neither reads nor answers pings: 0.4 s until the ping times
            # out, then the connection (and its cell) should end.
            try:
                await eventually(lambda: host.active_cells() == 0, timeout=2.0)
            except AssertionError:
                raise StillConnected("the connection was still served 2 s later") from None
        finally:
            silent.ws.abort()


# -- the CLI host as a child process --------------------------------------------------------------


@dataclass
class Child:
    """A ``codemode host`` child process in a process group of its own."""

    process: asyncio.subprocess.Process
    url: str = ""
    stderr: list[str] = field(default_factory=list)
    collector: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_kib(self) -> int:
        """``VmRSS`` of the host process (not its engines), in KiB."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
        assert match is not None, status
        return int(match.group(1))

    async def collect_stderr(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        while line := await stream.readline():
            self.stderr.append(line.decode("utf-8", "replace").rstrip("\n"))


@contextlib.asynccontextmanager
async def child_host(*arguments: str, stdio: bool = False) -> AsyncIterator[Child]:
    command = [sys.executable, "-m", "codemode", "host", *arguments]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE if stdio else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # the host and its engines are one group, killed together
    )
    child = Child(process)
    try:
        if not stdio:
            assert process.stdout is not None
            first = await asyncio.wait_for(process.stdout.readline(), 30)
            child.url = first.decode().strip()
            assert re.fullmatch(r"ws://127\.0\.0\.1:\d+", child.url), (first, child.stderr)
        child.collector = asyncio.ensure_future(child.collect_stderr())
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the host (if still running) and its engines
        if process.stdin is not None:
            process.stdin.transport.abort()
        if process.stdout is not None:
            # A stdout nobody read is paused: read it to its end, or wait() never returns.
            await asyncio.wait_for(process.stdout.read(), 10)
        await asyncio.wait_for(process.wait(), 10)
        if child.collector is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(child.collector, 5)


async def group_gone(pgid: int, timeout: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.02)
    return False


# -- 4. back-pressure ------------------------------------------------------------------------------

#: How much the host process may grow while a client floods it and never reads.
RSS_BOUND_KIB = 16 * 1024
FLOOD_SECONDS = 4.0


def wait_for_missing(request_id: int) -> OperationRequest:
    return OperationRequest(request_id, SessionWait(S1, WireWaitRequest("no-such-cell", 0)))


@dataclass
class Flood:
    requests: int = 0
    bytes: int = 0
    blocked_for: float = 0.0  # the longest stretch our writes could not drain
    rss_before: int = 0
    rss_peak: int = 0


async def flood(
    child: Child,
    write: Any,
    drain: Any,
    encode: Any,
    first_id: int,
) -> Flood:
    """Write ``session/wait`` requests as fast as the host takes them for ``FLOOD_SECONDS``, never
    reading an answer; sample the host's RSS throughout."""
    loop = asyncio.get_running_loop()
    stats = Flood(rss_before=child.rss_kib())
    stats.rss_peak = stats.rss_before
    next_id = first_id
    start = loop.time()
    blocked_since: float | None = None
    while loop.time() - start < FLOOD_SECONDS:
        if blocked_since is None:
            batch = b"".join(encode(wait_for_missing(next_id + i)) for i in range(200))
            next_id += 200
            write(batch)
            stats.requests += 200
            stats.bytes += len(batch)
        try:
            await asyncio.wait_for(drain(), 0.2)
        except TimeoutError:
            now = loop.time()
            blocked_since = now if blocked_since is None else blocked_since
            stats.blocked_for = max(stats.blocked_for, now - blocked_since)
        else:
            blocked_since = None
        stats.rss_peak = max(stats.rss_peak, child.rss_kib())
    return stats


def report(name: str, stats: Flood) -> str:
    grown = stats.rss_peak - stats.rss_before
    return (
        f"{name}: {stats.requests} requests ({stats.bytes / 2**20:.1f} MiB) written, "
        f"writes blocked for {stats.blocked_for:.1f} s, host RSS {stats.rss_before / 1024:.1f} "
        f"-> peak {stats.rss_peak / 1024:.1f} MiB (+{grown / 1024:.1f} MiB)"
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_websocket_client_that_never_reads_cannot_grow_the_host() -> None:
    async with child_host("--listen", "ws://127.0.0.1:0") as child:
        control = await open_single(child.url)
        await open_session(control, 1)
        await control.send(wait_for_missing(2))
        reply = await control.receive()
        assert isinstance(reply, OperationResponse) and reply.id == 2, reply
        await asyncio.sleep(0.3)
        writer = control.ws.writer

        def encode(message: ClientToHost) -> bytes:
            return rawws.encode_frame(Opcode.BINARY, encode_frame(message))

        stats = await flood(child, writer.write, writer.drain, encode, 3)
        print(report("websocket", stats))
        # The host stopped reading: our writes stayed blocked, though it had not run out of work.
        assert stats.blocked_for >= 1.0, report("websocket", stats)
        assert stats.rss_peak - stats.rss_before <= RSS_BOUND_KIB, report("websocket", stats)
        control.ws.abort()
        child.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.process.wait(), 20) == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_stdio_client_that_never_reads_cannot_grow_the_host() -> None:
    async with child_host("--stdio", stdio=True) as child:
        stdin, stdout = child.process.stdin, child.process.stdout
        assert stdin is not None and stdout is not None
        frames = FrameReader(stdout)
        stdin.write(frame(client_hello()) + frame(OperationRequest(1, SessionOpen(S1))))
        stdin.write(frame(wait_for_missing(2)))
        await stdin.drain()
        assert HOST_MESSAGES.decode(await frames.payload(30)) == SINGLE_READY
        assert HOST_MESSAGES.decode(await frames.payload(30)) == ok(1, SessionReady(S1))
        reply = HOST_MESSAGES.decode(await frames.payload(30))
        assert isinstance(reply, OperationResponse) and reply.id == 2, reply
        await asyncio.sleep(0.3)
        stats = await flood(child, stdin.write, stdin.drain, frame, 3)
        print(report("stdio", stats))
        assert stats.blocked_for >= 1.0, report("stdio", stats)
        assert stats.rss_peak - stats.rss_before <= RSS_BOUND_KIB, report("stdio", stats)


# -- 6. SIGTERM -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_sigterm_drains_then_stops_the_cli_host() -> None:
    grace = 1.5
    async with child_host("--listen", "ws://127.0.0.1:0", "--shutdown-grace", str(grace)) as child:
        control = await open_single(child.url)
        await open_session(control, 1)
        quick = "await new Promise((resolve) => setTimeout(resolve, 400)); text('finished');"
        await control.send(execute(2, S1, quick, yield_ms=600_000))
        await control.send(execute(3, S1, FOREVER, yield_ms=600_000))
        answers = await control.receive_many(2)
        cells: dict[int, str] = {}
        for answer in answers:
            assert isinstance(answer, OperationResponse), answer
            assert isinstance(answer.result, WireOk), answer
            assert isinstance(answer.result.value, ExecutionStarted), answer
            cells[answer.id] = answer.result.value.cell_id
        assert sorted(cells) == [2, 3]

        loop = asyncio.get_running_loop()
        signalled = loop.time()
        child.process.send_signal(signal.SIGTERM)

        # New connections are no longer accepted (refused or reset, or 503 while the listener
        # closes).
        deadline = signalled + 3.0
        while True:
            assert loop.time() < deadline, "the host kept accepting connections"
            try:
                ws = await rawws.connect(child.url)
            except HandshakeRejected as error:
                status = error.status
                break
            except (OSError, asyncio.IncompleteReadError):
                status = None  # refused, or reset by the closing listener
                break
            await ws.close()
            await asyncio.sleep(0.02)
        assert status in {None, 503}

        # Requests on the open connection are refused (H4); the running cells go on.
        await control.send(execute(4, S1, "text('late');"))
        received: list[HostToClient] = []
        while True:
            message = await control.ws.recv_message(timeout=grace + 5)
            if message is None or message.opcode == Opcode.CLOSE:
                break
            received.append(decode_framed(message.payload, HOST_MESSAGES))
        closed_after = loop.time() - signalled
        assert OperationResponse(4, WireError(HOST_SHUTTING_DOWN)) in received, received
        # The cell that finished within the grace completed; the other one got nothing more.
        finished = [m for m in received if isinstance(m, ExecuteInitialResponse)]
        assert finished == [result(2, cells[2], "finished")], received
        assert CellClosed(S1, cells[2]) in received, received
        # The connection (with the cell that was still running) ended once the grace was over.
        assert grace - 0.2 <= closed_after < grace + 3.0, closed_after

        status = await asyncio.wait_for(child.process.wait(), 15)
        assert status == 0
        assert await group_gone(child.pid), "an engine outlived the host"
        assert child.collector is not None
        await asyncio.wait_for(child.collector, 5)

    opens = [line for line in child.stderr if "event=connection-open" in line]
    closes = [line for line in child.stderr if "event=connection-close" in line]
    assert len(opens) == len(closes) >= 1, child.stderr
    assert re.search(r"event=connection-open connection=1 peer=127\.0\.0\.1:\d+$", opens[0]), opens
    first = next(line for line in closes if " connection=1 " in line)
    assert re.search(
        r"event=connection-close connection=1 peer=127\.0\.0\.1:\d+ seconds=\d+\.\d{3} "
        r"outcome=(clean|error)",
        first,
    ), closes
    assert any("event=shutting-down grace=1.5" in line for line in child.stderr), child.stderr
