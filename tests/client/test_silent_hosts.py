"""A remote host that goes silent (SIGSTOP: no socket closes, nothing answers) is noticed on every
carrier, idle or busy, within the settings the provider was given (``ping_interval``,
``ping_timeout``, ``response_timeout``); and those settings are validated.

Real host processes, real sockets. Each host runs in its own process group, killed (stopped or
not) when the test ends.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import contextlib
import math
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.client.grpc import GrpcCodeModeSessionProvider
from codemode.client.websocket import WebSocketCodeModeSessionProvider
from codemode.errors import CodeModeError, ConnectionClosed
from codemode.protocol import ExecuteRequest, InputText, Result, WaitRequest, Yielded
from codemode.session import CodeModeSession
from tests.contract.delegate import RecordingDelegate
from tests.upstream import LATEST_VERSION, unavailable_reason, upstream_host

ROOT = Path(__file__).resolve().parents[2]
#: A cell that runs until it is stopped.
FOREVER = "await new Promise(() => {});"
#: What a test allows a carrier to notice a stopped host (its settings are far shorter).
GENEROUS = 15.0
#: A lease (or subscription) of a gRPC session ended by the channel's keepalive.
GRPC_KEEPALIVE_FAILURE = re.compile(
    r"^gRPC code-mode (session lease|tool subscription) failed: UNAVAILABLE: "
)


@contextlib.asynccontextmanager
async def host_process(*command: str) -> AsyncIterator[tuple[int, str]]:
    """Start a host whose first stdout line is its URL; yield its pid and that URL."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    child = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,  # its engines too are killed with it
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        assert child.stdout is not None
        url = (await asyncio.wait_for(child.stdout.readline(), 60)).decode().strip()
        assert url, "the host printed no URL"
        yield child.pid, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # a stopped process is killed too
        await asyncio.wait_for(child.wait(), 10)


def our_grpc_host() -> contextlib.AbstractAsyncContextManager[tuple[int, str]]:
    """``codemode host --listen grpc://`` that permits a client ping every 0.5 s."""
    return host_process(
        *(sys.executable, "-m", "codemode", "host", "--listen", "grpc://127.0.0.1:0"),
        *("--min-client-ping-interval", "0.5"),
    )


async def until_dead(session: CodeModeSession) -> float:
    """Seconds until ``session`` is no longer alive (the test fails past ``GENEROUS``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while session.is_alive():
        assert loop.time() - started < GENEROUS, "the stopped host was not noticed"
        await asyncio.sleep(0.02)
    return loop.time() - started


async def running_cell(session: CodeModeSession) -> Any:
    cell = await session.execute(ExecuteRequest("c", FOREVER, [], 1, None))
    assert isinstance(await cell.initial_response(), Yielded)
    return cell


async def settled(pending: list[Awaitable[Any]]) -> list[Any]:
    """The outcomes of ``pending``, which must all settle within ``GENEROUS`` seconds."""
    futures = [asyncio.ensure_future(call) for call in pending]
    return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), GENEROUS)


# -- gRPC --------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_grpc_an_idle_session_on_a_stopped_host_is_noticed_by_keepalive() -> None:
    async with our_grpc_host() as (pid, url):
        provider = GrpcCodeModeSessionProvider(
            url, ping_interval=1.0, ping_timeout=1.0, response_timeout=2.0
        )
        delegate = RecordingDelegate()
        try:
            session = await provider.create_session(delegate)
            cell = await running_cell(session)
            await asyncio.sleep(3.0)  # idle: the host permits these pings
            assert session.is_alive(), session.failure
            os.kill(pid, signal.SIGSTOP)
            await until_dead(session)
            failure = session.failure
            assert failure is not None and GRPC_KEEPALIVE_FAILURE.match(failure), failure
            assert delegate.closed == [str(cell.cell_id)]
            # Calls on the dead session fail with its recorded reason, at once...
            with pytest.raises(ConnectionClosed) as caught:
                await asyncio.wait_for(session.terminate(cell.cell_id), 1.0)
            assert str(caught.value) == failure
            # ...and an execute that reconnects is bounded by response_timeout (no answer).
            with pytest.raises(CodeModeError) as opening:
                await asyncio.wait_for(session.execute(ExecuteRequest("c", "1")), GENEROUS)
            assert str(opening.value) == (
                "gRPC code-mode host timed out waiting for session opening response"
            )
        finally:
            await asyncio.wait_for(provider.aclose(), GENEROUS)


@pytest.mark.timeout(90)
async def test_grpc_a_busy_session_on_a_stopped_host_fails_its_pending_calls_by_keepalive() -> None:
    async with our_grpc_host() as (pid, url):
        # The default response_timeout (60 s): only the keepalive can notice the host in time.
        provider = GrpcCodeModeSessionProvider(url, ping_interval=1.0, ping_timeout=1.0)
        delegate = RecordingDelegate()
        try:
            session = await provider.create_session(delegate)
            cell = await running_cell(session)
            other = await session.execute(ExecuteRequest("c", FOREVER, [], 60_000, None))
            os.kill(pid, signal.SIGSTOP)
            results = await settled(
                [
                    session.wait(WaitRequest(cell.cell_id, 60_000)),
                    other.initial_response(),
                    session.terminate(cell.cell_id),
                ]
            )
            failure = session.failure
            assert failure is not None and GRPC_KEEPALIVE_FAILURE.match(failure), failure
            for result in results:
                assert isinstance(result, ConnectionClosed), result
                assert str(result) == failure
            assert not session.is_alive()
            assert sorted(delegate.closed) == sorted([str(cell.cell_id), str(other.cell_id)])
        finally:
            await asyncio.wait_for(provider.aclose(), GENEROUS)


@pytest.mark.timeout(90)
async def test_grpc_keepalive_pings_are_tolerated_by_the_upstream_host() -> None:
    binary = upstream_host(LATEST_VERSION)
    if binary is None:
        pytest.skip(unavailable_reason(LATEST_VERSION))
    async with host_process(str(binary), "--listen", "grpc://127.0.0.1:0") as (pid, url):
        provider = GrpcCodeModeSessionProvider(url, ping_interval=0.2, ping_timeout=1.0)
        try:
            session = await provider.create_session(RecordingDelegate())
            await asyncio.sleep(3.0)  # idle, some fifteen pings: no GOAWAY
            assert session.is_alive(), session.failure
            cell = await session.execute(ExecuteRequest("c", "text('ok')"))
            assert await cell.initial_response() == Result(cell.cell_id, [InputText("ok")])
            os.kill(pid, signal.SIGSTOP)
            await until_dead(session)
            failure = session.failure
            assert failure is not None and GRPC_KEEPALIVE_FAILURE.match(failure), failure
        finally:
            await asyncio.wait_for(provider.aclose(), GENEROUS)


# -- Protocol V1 -------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_websocket_an_idle_session_on_a_stopped_host_is_noticed_by_keepalive() -> None:
    async with host_process(
        sys.executable, "-m", "codemode", "host", "--listen", "ws://127.0.0.1:0"
    ) as (pid, url):
        provider = WebSocketCodeModeSessionProvider(url, ping_interval=0.5, ping_timeout=1.0)
        try:
            session = await provider.create_session(RecordingDelegate())
            os.kill(pid, signal.SIGSTOP)
            await until_dead(session)
            failure = session.connection.failure
            assert failure is not None and "keepalive ping timeout" in failure, failure
            with pytest.raises(ConnectionClosed) as caught:
                await asyncio.wait_for(session.execute(ExecuteRequest("c", "1")), 1.0)
            assert str(caught.value) == failure
        finally:
            await asyncio.wait_for(provider.aclose(), GENEROUS)


@pytest.mark.timeout(90)
async def test_websocket_without_pings_a_stopped_host_fails_pending_calls_at_response_timeout() -> (
    None
):
    async with host_process(
        sys.executable, "-m", "codemode", "host", "--listen", "ws://127.0.0.1:0"
    ) as (pid, url):
        provider = WebSocketCodeModeSessionProvider(url, ping_interval=None, response_timeout=1.0)
        try:
            session = await provider.create_session(RecordingDelegate())
            cell = await running_cell(session)
            os.kill(pid, signal.SIGSTOP)
            results = await settled([session.wait(WaitRequest(cell.cell_id, 500))])
            for result in results:
                assert isinstance(result, ConnectionClosed), result
                assert str(result) == "code-mode host timed out waiting for wait response"
            assert not session.is_alive()
        finally:
            await asyncio.wait_for(provider.aclose(), GENEROUS)


# -- the settings ------------------------------------------------------------------------------

PROVIDERS: dict[str, Callable[..., Any]] = {
    "stdio": ProcessOwnedCodeModeSessionProvider,
    "websocket": lambda **options: WebSocketCodeModeSessionProvider("ws://127.0.0.1:1", **options),
    "grpc": lambda **options: GrpcCodeModeSessionProvider("grpc://127.0.0.1:1", **options),
}


@pytest.mark.parametrize("carrier", PROVIDERS)
def test_response_timeout_defaults_to_60_s_and_can_be_changed(carrier: str) -> None:
    make = PROVIDERS[carrier]
    assert make().response_timeout == 60.0
    assert make(response_timeout=2.5).response_timeout == 2.5


@pytest.mark.parametrize("carrier", PROVIDERS)
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "5"])
def test_response_timeout_must_be_a_positive_finite_number_of_seconds(
    carrier: str, value: object
) -> None:
    expected = f"response_timeout must be a positive finite number of seconds, not {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        PROVIDERS[carrier](response_timeout=value)


@pytest.mark.parametrize("option", ["ping_interval", "ping_timeout", "open_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf])
def test_grpc_keepalive_settings_are_validated(option: str, value: float) -> None:
    expected = f"{option} must be a positive finite number of seconds, not {value!r}"
    options: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        GrpcCodeModeSessionProvider("grpc://127.0.0.1:1", **options)


@pytest.mark.parametrize("option", ["ping_interval", "ping_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "5"])
def test_websocket_keepalive_settings_are_validated(option: str, value: object) -> None:
    # They went to websockets unchecked, which failed at the first connection (or never pinged).
    expected = f"{option} must be a positive finite number of seconds, not {value!r}"
    options: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        WebSocketCodeModeSessionProvider("ws://127.0.0.1:1", **options)
    off: dict[str, Any] = {option: None}
    assert WebSocketCodeModeSessionProvider("ws://127.0.0.1:1", **off)
