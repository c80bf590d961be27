"""WebSocketCodeModeSessionProvider and connect_websocket against a real WebSocket host
(``protocol-v1.md`` §7.2, §7.3, §9.1, §9.8): an in-process :class:`WebSocketHost` in front of the
real embedded runtime on 127.0.0.1, single socket and control + bulk pair."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from codemode.client.websocket import WebSocketCodeModeSessionProvider, connect_websocket
from codemode.errors import CodeModeError, ConnectionClosed
from codemode.host.websocket import WebSocketAddress, WebSocketHost
from codemode.protocol import (
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    Result,
    WaitRequest,
    Yielded,
)
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.runtime import LocalSessionProvider
from tests.client.fakes import ScriptedDelegate
from tests.contract.delegate import BLOCK, ECHO, RecordingDelegate, function_tool
from tests.proxy import FreezingProxy

TOKEN = "client-token"
BIG = function_tool("big", "returns a 5 MiB string")
FIVE_MIB = 5 << 20
FOREVER = "await new Promise((resolve) => setTimeout(resolve, 600000)); text('never');"


def request(source: str, tools: Any = (), yield_ms: int = 10_000) -> ExecuteRequest:
    return ExecuteRequest("call-1", source, list(tools), yield_ms, None)


@pytest.fixture
async def runtime() -> AsyncIterator[LocalSessionProvider]:
    async with LocalSessionProvider() as instance:
        yield instance


@contextlib.asynccontextmanager
async def listening(
    runtime: LocalSessionProvider, port: int = 0, **options: Any
) -> AsyncIterator[WebSocketHost]:
    host = WebSocketHost(runtime, WebSocketAddress("127.0.0.1", port), **options)
    await host.start()
    try:
        yield host
    finally:
        async with asyncio.timeout(15):
            await host.aclose()


@contextlib.asynccontextmanager
async def session_provider(
    url: str, **options: Any
) -> AsyncIterator[WebSocketCodeModeSessionProvider]:
    provider = WebSocketCodeModeSessionProvider(url, **options)
    try:
        yield provider
    finally:
        async with asyncio.timeout(15):
            await provider.aclose()


def big_delegate() -> ScriptedDelegate:
    return ScriptedDelegate(
        behaviour={
            "big": lambda _input, _token: "x" * FIVE_MIB,
            "echo": lambda value, _token: value,
        }
    )


async def exercise(provider: WebSocketCodeModeSessionProvider) -> None:
    """Execute, a nested tool call with a 5 MiB result, and a notification, on one session."""
    delegate = big_delegate()
    session = await provider.create_session(delegate)
    cell = await session.execute(request("text('hi');"))
    assert await cell.initial_response() == Result(cell.cell_id, [InputText("hi")], None)

    source = (
        "const r = await tools.big({}); notify('got ' + r.length); "
        "const e = await tools.echo({v: r.slice(0, 3)}); text(String(r.length) + e.v);"
    )
    cell = await session.execute(request(source, [BIG, ECHO]))
    response = await asyncio.wait_for(cell.initial_response(), 30)
    assert response == Result(cell.cell_id, [InputText(f"{FIVE_MIB}xxx")], None)
    assert delegate.notes == [f"got {FIVE_MIB}"]
    await session.shutdown()
    assert delegate.closed == ["1", "2"]


# -- single and dual ---------------------------------------------------------------------------


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_sessions_over_one_and_two_sockets(runtime: LocalSessionProvider, dual: bool) -> None:
    async with listening(runtime) as host, session_provider(host.url, dual=dual) as provider:
        await exercise(provider)
        link = provider.link
        assert link is not None
        negotiated = link.connection.negotiated
        assert negotiated.dual_websocket is dual
        assert (negotiated.bulk_connection_token is not None) is dual
        assert SESSION_RESOURCE_LIMITS_CAPABILITY in negotiated.capabilities
        # A second session shares the connection.
        second = await provider.create_session(RecordingDelegate())
        assert second.connection is link.connection
        cell = await second.execute(request("text((await tools.echo({v: 1})).v);", [ECHO]))
        assert await cell.initial_response() == Result(cell.cell_id, [InputText("1")], None)


async def test_limits_are_granted_over_websocket(runtime: LocalSessionProvider) -> None:
    async with listening(runtime) as host, session_provider(host.url, dual=True) as provider:
        limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=50)
        session = await provider.create_session_with_limits(RecordingDelegate(), limits)
        cell = await session.execute(request("while (true) {}", yield_ms=60_000))
        assert isinstance(await asyncio.wait_for(cell.initial_response(), 5), Yielded)
        await session.terminate(cell.cell_id)


async def test_dual_falls_back_to_one_socket_when_not_granted(
    runtime: LocalSessionProvider,
) -> None:
    async with (
        listening(runtime, dual=False) as host,
        session_provider(host.url, dual=True) as provider,
    ):
        await exercise(provider)
        link = provider.link
        assert link is not None
        negotiated = link.connection.negotiated
        assert DUAL_WEBSOCKET_CAPABILITY not in negotiated.capabilities
        assert negotiated.bulk_connection_token is None


# -- tokens ------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_a_missing_or_wrong_token_is_refused(
    runtime: LocalSessionProvider, token: str | None
) -> None:
    async with listening(runtime, token=TOKEN) as host:
        for dual in (False, True):
            async with session_provider(host.url, dual=dual, token=token) as provider:
                with pytest.raises(CodeModeError) as caught:
                    await provider.create_session(RecordingDelegate())
                assert caught.value.message == (
                    f"failed to connect to code-mode host {host.url}: HTTP 401"
                )
                assert provider.link is None


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_the_right_token_opens_both_sockets(
    runtime: LocalSessionProvider, dual: bool
) -> None:
    async with (
        listening(runtime, token=TOKEN) as host,
        session_provider(host.url, dual=dual, token=TOKEN) as provider,
    ):
        await exercise(provider)
        link = provider.link
        assert link is not None
        assert link.connection.negotiated.dual_websocket is dual


async def test_connect_websocket_reports_an_unreachable_host() -> None:
    async with listening_nowhere() as url:
        with pytest.raises(CodeModeError, match=r"^failed to connect to code-mode host ws://"):
            await connect_websocket(url, handshake_timeout=2.0)


@contextlib.asynccontextmanager
async def listening_nowhere() -> AsyncIterator[str]:
    """A loopback URL whose port nobody listens on (bound, then released)."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = next(iter(server.sockets)).getsockname()[1]
    server.close()
    await server.wait_closed()
    yield f"ws://127.0.0.1:{port}"


# -- death and replacement ---------------------------------------------------------------------


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_a_dead_connection_is_replaced_by_the_next_session(
    runtime: LocalSessionProvider, dual: bool
) -> None:
    async with listening(runtime) as first_host:
        url = first_host.url
        port = int(url.rsplit(":", 1)[1])
        async with session_provider(url, dual=dual) as provider:
            old = await provider.create_session(RecordingDelegate())
            old_connection = old.connection
            await first_host.aclose()  # the host goes away ...
            await asyncio.wait_for(old_connection.wait_closed(), 5)
            assert not old.is_alive()
            assert provider.link is None
            with pytest.raises(ConnectionClosed):
                await old.execute(request("text('x');"))
            async with listening(runtime, port) as second_host:  # ... and comes back
                assert second_host.url == url
                new = await provider.create_session(RecordingDelegate())
                assert new.connection is not old_connection
                assert new.connection.is_alive()
                cell = await new.execute(request("text('again');"))
                assert await cell.initial_response() == Result(
                    cell.cell_id, [InputText("again")], None
                )
                assert not old.is_alive()  # dead sessions are never revived


async def pending_calls(
    provider: WebSocketCodeModeSessionProvider,
) -> list[asyncio.Future[Any]]:
    """A busy cell, a cell blocked in a tool call and a wait, all still pending."""
    session = await provider.create_session(RecordingDelegate())
    busy = await session.execute(request("while (true) {}", yield_ms=600_000))
    blocked = await session.execute(
        request("await tools.block({}); text('never');", [BLOCK], yield_ms=600_000)
    )
    observed = await session.execute(request(FOREVER, yield_ms=0))
    assert isinstance(await observed.initial_response(), Yielded)
    pending: list[asyncio.Future[Any]] = [
        asyncio.ensure_future(busy.initial_response()),
        asyncio.ensure_future(blocked.initial_response()),
        asyncio.ensure_future(session.wait(WaitRequest(observed.cell_id, 600_000))),
    ]
    await asyncio.sleep(0.2)
    assert not any(task.done() for task in pending)
    return pending


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_the_host_going_away_fails_pending_calls_promptly(
    runtime: LocalSessionProvider, dual: bool
) -> None:
    async with listening(runtime) as host, session_provider(host.url, dual=dual) as provider:
        pending = await pending_calls(provider)
        loop = asyncio.get_running_loop()
        started = loop.time()
        closing = asyncio.ensure_future(host.aclose())
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 2.0)
        assert loop.time() - started < 1.0
        for outcome in results:
            assert isinstance(outcome, ConnectionClosed), outcome
        await closing


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_a_killed_host_process_fails_pending_calls_promptly(dual: bool) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "codemode",
        "host",
        "--listen",
        "ws://127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        assert re.fullmatch(r"ws://127\.0\.0\.1:\d+", url), url
        async with session_provider(url, dual=dual) as provider:
            pending = await pending_calls(provider)
            loop = asyncio.get_running_loop()
            started = loop.time()
            os.killpg(process.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 2.0)
            assert loop.time() - started < 1.0
            for outcome in results:
                assert isinstance(outcome, ConnectionClosed), outcome
            assert provider.link is None
            with pytest.raises(CodeModeError, match=r"^failed to connect to code-mode host "):
                await provider.create_session(RecordingDelegate())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.wait_for(process.wait(), 10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_the_provider_s_keepalive_fails_pending_calls_of_a_silent_host(
    runtime: LocalSessionProvider, dual: bool
) -> None:
    async with listening(runtime) as host:
        proxy = FreezingProxy(WebSocketAddress.parse(host.url).port)
        address = await proxy.start()
        url = host.url.replace(host.url.split("/")[2], address)
        try:
            async with session_provider(
                url, dual=dual, ping_interval=0.2, ping_timeout=0.3
            ) as provider:
                session = await provider.create_session(RecordingDelegate())
                cell = await session.execute(request(FOREVER, yield_ms=600_000))
                pending = asyncio.ensure_future(cell.initial_response())
                proxy.frozen.set()  # the host goes silent; no socket closes
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(ConnectionClosed, match="keepalive ping timeout"):
                    await asyncio.wait_for(pending, 5)
                assert loop.time() - started < 2.0
                assert not session.is_alive()
        finally:
            await proxy.aclose()
