"""ProcessOwnedCodeModeSessionProvider: spawning, sharing, death and cleanup of host children.

Tests against the real ``python -m codemode host --stdio`` and a scripted stand-in
(``scripted_host.py``). Every provider is closed in a ``finally``, and the tests check that
the child's whole process group is gone.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from codemode.client import DEFAULT_HOST_COMMAND, ProcessOwnedCodeModeSessionProvider
from codemode.errors import CodeModeError, ConnectionClosed
from codemode.protocol import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    Result,
    WaitRequest,
    Yielded,
)
from codemode.protocol.constants import HANDSHAKE_TIMEOUT
from tests.contract.delegate import BLOCK, ECHO, RecordingDelegate

ROOT = Path(__file__).resolve().parents[2]


def scripted(
    mode: str, *, handshake_timeout: float = HANDSHAKE_TIMEOUT
) -> ProcessOwnedCodeModeSessionProvider:
    """A provider whose host is ``scripted_host`` in ``mode`` (``MODE ARG`` words)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return ProcessOwnedCodeModeSessionProvider(
        [sys.executable, "-m", "tests.client.scripted_host", *mode.split()],
        env={**os.environ, "PYTHONPATH": path},
        handshake_timeout=handshake_timeout,
    )


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def eventually_gone(pgid: int, timeout: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not group_gone(pgid):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_default_command() -> None:
    assert ProcessOwnedCodeModeSessionProvider().command == [
        sys.executable,
        "-m",
        "codemode",
        "host",
        "--stdio",
    ]
    assert list(DEFAULT_HOST_COMMAND[1:]) == ["-m", "codemode", "host", "--stdio"]


# -- the real host -------------------------------------------------------------------------------


def signal_host(provider: ProcessOwnedCodeModeSessionProvider, signum: int) -> int:
    """Send ``signum`` to the provider's host process; return its pid."""
    host = provider.host
    assert host is not None
    os.kill(host.pid, signum)
    return host.pid


async def test_one_host_is_shared_by_every_session(
    provider: ProcessOwnedCodeModeSessionProvider,
) -> None:
    first_delegate, second_delegate = RecordingDelegate(), RecordingDelegate()
    first = await provider.create_session(first_delegate)
    second = await provider.create_session(second_delegate)
    assert (first.session_id, second.session_id) == ("session-1", "session-2")
    assert first.connection is second.connection
    host = provider.host
    assert host is not None
    source = "const r = await tools.echo({value: 'ping'}); text(r.value);"
    cell = await second.execute(ExecuteRequest("call-1", source, [ECHO], 10_000, None))
    assert await cell.initial_response() == Result(cell.cell_id, [InputText("ping")], None)
    await second.shutdown()
    assert second_delegate.closed == [str(cell.cell_id)]
    third = await provider.create_session(RecordingDelegate())
    assert third.connection is first.connection and provider.host is host


async def test_limits_are_granted_by_the_real_host(
    provider: ProcessOwnedCodeModeSessionProvider,
) -> None:
    limits = CodeModeSessionCellExecutionLimits(max_yield_time_ms=50)
    session = await provider.create_session_with_limits(RecordingDelegate(), limits)
    cell = await session.execute(ExecuteRequest("c", "while (true) {}", [], 60_000, None))
    response = await asyncio.wait_for(cell.initial_response(), 5)
    assert response.cell_id == cell.cell_id
    await session.shutdown()


async def test_killing_the_host_mid_cell_fails_every_pending_call_within_one_second(
    provider: ProcessOwnedCodeModeSessionProvider,
) -> None:
    delegate = RecordingDelegate()
    session = await provider.create_session(delegate)
    busy = await session.execute(ExecuteRequest("c1", "while (true) {}", [], 60_000, None))
    blocked = await session.execute(
        ExecuteRequest("c2", "await tools.block({}); text('never');", [BLOCK], 60_000, None)
    )
    observed = await session.execute(ExecuteRequest("c3", "while (true) {}", [], 0, None))
    assert isinstance(await observed.initial_response(), Yielded)
    pending = [
        asyncio.ensure_future(busy.initial_response()),
        asyncio.ensure_future(blocked.initial_response()),
        asyncio.ensure_future(session.wait(WaitRequest(observed.cell_id, 60_000))),
    ]
    await asyncio.sleep(0.3)
    assert not any(task.done() for task in pending)
    pid = signal_host(provider, signal.SIGKILL)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 1.0)
    assert loop.time() - started < 1.0
    for result in results:
        assert isinstance(result, ConnectionClosed), result
        assert result.message == "code-mode host exited with status -9"
    assert not session.is_alive()
    with pytest.raises(ConnectionClosed, match=r"^code-mode host exited with status -9$"):
        await session.execute(ExecuteRequest("c5", "1", [], None, None))
    await asyncio.wait_for(session.shutdown(), 1.0)  # a dead session's shutdown succeeds
    cells = [busy.cell_id, blocked.cell_id, observed.cell_id]
    assert sorted(delegate.closed) == sorted(str(cell) for cell in cells)
    assert await eventually_gone(pid)  # the host's whole process group was killed

    # The dead host is never reused: the next session gets a fresh process.
    fresh = await provider.create_session(RecordingDelegate())
    assert fresh.is_alive() and provider.host is not None
    assert provider.host.pid != pid
    cell = await fresh.execute(ExecuteRequest("c4", "text('ok')", [], 10_000, None))
    assert await cell.initial_response() == Result(cell.cell_id, [InputText("ok")], None)
    assert not session.is_alive()


@pytest.mark.timeout(60)
async def test_a_stopped_host_fails_pending_calls_at_their_deadline_and_is_killed() -> None:
    # A pipe carries no keepalive: a host that stops answering (here SIGSTOP) is noticed only by
    # the deadline of each request (60 s past its runtime allowance; here 0.5 s).
    provider = ProcessOwnedCodeModeSessionProvider(response_timeout=0.5)
    try:
        await stopped_host_fails_pending_calls(provider)
    finally:
        await provider.aclose()


async def stopped_host_fails_pending_calls(provider: ProcessOwnedCodeModeSessionProvider) -> None:
    delegate = RecordingDelegate()
    session = await provider.create_session(delegate)
    observed = await session.execute(ExecuteRequest("c1", "while (true) {}", [], 500, None))
    assert isinstance(await observed.initial_response(), Yielded)  # an answer in time is kept
    blocked = await session.execute(
        ExecuteRequest("c2", "await tools.block({}); text('never');", [BLOCK], 500, None)
    )
    while not delegate.calls:  # the host is serving the tool call when it stops
        await asyncio.sleep(0.01)
    pid = signal_host(provider, signal.SIGSTOP)
    loop = asyncio.get_running_loop()
    started = loop.time()
    pending = [
        asyncio.ensure_future(blocked.initial_response()),
        asyncio.ensure_future(session.wait(WaitRequest(observed.cell_id, 500))),
    ]
    results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
    assert loop.time() - started < 3.0
    reason = "code-mode host timed out waiting for execution response"
    for result in results:
        assert isinstance(result, ConnectionClosed), result
        assert result.message == reason
    assert not session.is_alive()
    with pytest.raises(ConnectionClosed, match=f"^{reason}$"):
        await session.execute(ExecuteRequest("c3", "1", [], None, None))
    await asyncio.wait_for(session.shutdown(), 1.0)
    assert sorted(delegate.closed) == sorted([str(observed.cell_id), str(blocked.cell_id)])
    assert delegate.cancelled == ["tool-1"]
    assert await eventually_gone(pid)  # the stopped host's whole process group was killed


async def test_aclose_shuts_down_and_leaves_no_process() -> None:
    provider = ProcessOwnedCodeModeSessionProvider()
    try:
        session = await provider.create_session(RecordingDelegate())
        host = provider.host
        assert host is not None
        pid = host.pid
        cell = await session.execute(ExecuteRequest("c", "while (true) {}", [], 60_000, None))
        assert cell.cell_id == CellId("1")
    finally:
        await provider.aclose()
    assert host.process.returncode is not None
    assert await eventually_gone(pid)
    assert not session.is_alive()
    with pytest.raises(CodeModeError, match=r"^code-mode session provider is closed$"):
        await provider.create_session(RecordingDelegate())


# -- spawn and handshake failures ----------------------------------------------------------------


async def test_spawn_failure_is_c1() -> None:
    provider = ProcessOwnedCodeModeSessionProvider(["/nonexistent/codemode-host", "host"])
    try:
        with pytest.raises(CodeModeError) as caught:
            await provider.create_session(RecordingDelegate())
    finally:
        await provider.aclose()
    assert caught.value.message.startswith(
        "failed to spawn code-mode host /nonexistent/codemode-host: "
    )
    assert "No such file or directory" in caught.value.message


async def test_host_exiting_before_the_reply_is_c3() -> None:
    provider = scripted("exit-now 3")
    try:
        with pytest.raises(CodeModeError, match=r"^code-mode host exited during handshake$"):
            await provider.create_session(RecordingDelegate())
    finally:
        await provider.aclose()


async def test_silent_host_is_c2_and_killed() -> None:
    provider = scripted("silent", handshake_timeout=0.3)
    try:
        with pytest.raises(CodeModeError, match=r"^timed out negotiating with the code-mode host$"):
            await provider.create_session(RecordingDelegate())
        assert provider.host is None
    finally:
        await provider.aclose()


# -- connection death: K2 vs K1 ------------------------------------------------------------------


async def test_exit_status_is_k2() -> None:
    provider = scripted("exit-on-request 7")
    try:
        # The open itself is the first request: the host exits instead of answering.
        with pytest.raises(ConnectionClosed, match=r"^code-mode host exited with status 7$"):
            await asyncio.wait_for(provider.create_session(RecordingDelegate()), 2)
    finally:
        await provider.aclose()


async def test_closed_stdout_of_a_living_host_is_k1_and_the_host_is_killed() -> None:
    provider = scripted("close-stdout")
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ConnectionClosed, match=r"^code-mode host connection closed$"):
            await asyncio.wait_for(provider.create_session(RecordingDelegate()), 3)
        # The client waited (about) the 1 s grace for an exit status before choosing K1.
        assert loop.time() - started >= 0.9
        assert provider.host is None
    finally:
        await provider.aclose()


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_closed_stdout_of_a_living_host_is_seen_on_uvloop() -> None:
    # uvloop's spawn leaves the child copies of its pipes: without the client's preexec, the
    # host's closed stdout stayed open through a copy and the client waited for ever.
    import uvloop

    uvloop.run(test_closed_stdout_of_a_living_host_is_k1_and_the_host_is_killed())


async def test_limits_not_granted_are_c7_and_stderr_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="codemode.client.process")
    provider = scripted("basic")
    try:
        limits = CodeModeSessionCellExecutionLimits(max_heap_size_bytes=1 << 24)
        with pytest.raises(CodeModeError) as caught:
            await provider.create_session_with_limits(RecordingDelegate(), limits)
        assert caught.value.message == (
            "code-mode host does not support session resource limits: "
            "missing `session-cell-execution-resource-limits` capability"
        )
        session = await provider.create_session_with_limits(
            RecordingDelegate(), CodeModeSessionCellExecutionLimits()
        )
        await session.shutdown()
        assert session.session_id == "session-1"
    finally:
        await provider.aclose()
    assert any("scripted host ready" in record.getMessage() for record in caplog.records)


async def test_concurrent_first_use_spawns_one_host() -> None:
    provider = scripted("basic")
    try:
        sessions = await asyncio.gather(
            *(provider.create_session(RecordingDelegate()) for _ in range(3))
        )
        assert len({id(session.connection) for session in sessions}) == 1
        assert sorted(session.session_id for session in sessions) == [
            "session-1",
            "session-2",
            "session-3",
        ]
    finally:
        await provider.aclose()
