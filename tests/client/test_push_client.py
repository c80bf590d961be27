"""The stdio client reads by push: its host's frames are dispatched in the loop iteration that
read them (``docs/decisions/0014-push-client.md``).

What that must not change: back-pressure (the client's own reads never stop for its writes, so
it cannot deadlock with a host that pauses its reading; callers still wait for the pipe), a host
that dies inside a frame, and every pending operation failing promptly when the host goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.errors import ConnectionClosed
from codemode.protocol import ExecuteRequest, InputText, Result
from codemode.protocol.types import JSON, CodeModeNestedToolCall
from codemode.protocol.v1.lanes import Lane
from codemode.session import CancellationToken
from codemode.transports.stream import StreamTransport, pipe_transport
from tests.client.test_process import eventually_gone
from tests.contract.delegate import ECHO, RecordingDelegate

ROOT = Path(__file__).resolve().parents[2]


def partial_host(mode: str) -> ProcessOwnedCodeModeSessionProvider:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return ProcessOwnedCodeModeSessionProvider(
        [sys.executable, "-m", "tests.client.scripted_partial_host", *mode.split()],
        env={**os.environ, "PYTHONPATH": path},
    )


def text_of(response: Any) -> str:
    assert isinstance(response, Result), response
    return "".join(item.text for item in response.content_items if isinstance(item, InputText))


# -- the transport ------------------------------------------------------------------------------


class _Backlog:
    """A writer whose transport reports a write buffer above its high-water mark."""

    class _Transport(asyncio.WriteTransport):
        def get_write_buffer_size(self) -> int:
            return 1 << 20

        def get_write_buffer_limits(self) -> tuple[int, int]:
            return (1 << 14, 1 << 16)

    def __init__(self) -> None:
        self.transport = self._Transport()

    def write(self, data: bytes | bytearray) -> None:
        return None

    async def drain(self) -> None:
        await asyncio.sleep(3600)  # never drains

    def close(self) -> None:
        return None

    def is_closing(self) -> bool:
        return False

    async def wait_closed(self) -> None:
        return None


async def _backlogged_pipe(pause: bool) -> tuple[StreamTransport, int, list[bytes]]:
    read_end, write_end = os.pipe()
    transport = await pipe_transport(
        os.fdopen(read_end, "rb", 0), _Backlog(), pause_while_backlogged=pause
    )
    seen: list[bytes] = []
    transport.push_to(lambda data, lane: seen.append(data))
    return transport, write_end, seen


async def _settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_host_side_pipe_pauses_while_its_writes_back_up() -> None:
    transport, write_end, seen = await _backlogged_pipe(pause=True)
    try:
        receiving = asyncio.ensure_future(transport.receive())
        os.write(write_end, b"one")
        # The read is pushed, then reading pauses: receive() returns to let its caller drain.
        assert await asyncio.wait_for(receiving, 5) == (b"", Lane.CONTROL)
        os.write(write_end, b"two")
        await _settled()
        assert seen == [b"one"]  # paused: nothing more is read until the next receive()
    finally:
        await transport.close()
        os.close(write_end)


async def test_the_client_side_pipe_keeps_reading_while_its_writes_back_up() -> None:
    transport, write_end, seen = await _backlogged_pipe(pause=False)
    try:
        receiving = asyncio.ensure_future(transport.receive())
        for chunk in (b"one", b"two", b"three"):
            os.write(write_end, chunk)
            await _settled()
        assert seen == [b"one", b"two", b"three"]
        assert not receiving.done()  # no pause: receive() reports only the end
        os.close(write_end)
        assert await asyncio.wait_for(receiving, 5) is None
    finally:
        await transport.close()


# -- the client over a real host ----------------------------------------------------------------


async def test_the_process_client_reads_by_push(
    provider: ProcessOwnedCodeModeSessionProvider,
) -> None:
    session = await provider.create_session(RecordingDelegate())
    host = provider.host
    assert host is not None
    transport = host.connection._transport
    assert isinstance(transport, StreamTransport) and transport.pushes
    source = "let n = 0; for (let i = 0; i < 20; i++) { n += (await tools.echo({i})).i; } text(n)"
    started = await session.execute(ExecuteRequest("push", source, [ECHO]))
    assert text_of(await asyncio.wait_for(started.initial_response(), 30)) == "190"


class _BigEcho(RecordingDelegate):
    """Answers every call with a large value (the client's writes outgrow the pipe)."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        return {"pad": "y" * 40_000, "i": invocation.input}


async def test_large_calls_in_both_directions_at_once_do_not_deadlock(
    provider: ProcessOwnedCodeModeSessionProvider,
) -> None:
    # 300 calls with 40 kB arguments and 40 kB results in flight: both ends' writes back up far
    # above their high-water marks. The host pauses its reading meanwhile; the client must not,
    # or each would wait for the other to read.
    session = await provider.create_session(_BigEcho())
    source = (
        "const pad = 'x'.repeat(40000);"
        " const out = await Promise.all(Array.from({length: 300}, (_, i) =>"
        " tools.echo({i, pad})));"
        " text(String(out.reduce((n, r) => n + r.pad.length, 0)))"
    )
    started = await session.execute(ExecuteRequest("big", source, [ECHO], yield_time_ms=60_000))
    assert text_of(await asyncio.wait_for(started.initial_response(), 60)) == str(300 * 40_000)


# -- a host that dies inside a frame ------------------------------------------------------------


async def test_a_host_exiting_inside_a_frame_fails_the_pending_call_with_k2() -> None:
    provider = partial_host("exit 5")
    try:
        session = await provider.create_session(RecordingDelegate())
        host = provider.host
        assert host is not None
        with pytest.raises(ConnectionClosed, match=r"^code-mode host exited with status 5$"):
            await asyncio.wait_for(session.execute(ExecuteRequest("x", "text(1)")), 3)
        assert not session.is_alive()
        assert await eventually_gone(host.pid)
    finally:
        await provider.aclose()


async def test_a_living_host_whose_stream_ends_inside_a_frame_fails_the_pending_call() -> None:
    provider = partial_host("close")
    try:
        session = await provider.create_session(RecordingDelegate())
        host = provider.host
        assert host is not None
        with pytest.raises(ConnectionClosed, match=r"truncated") as raised:
            await asyncio.wait_for(session.execute(ExecuteRequest("x", "text(1)")), 3)
        assert "declared" in str(raised.value)
        assert not session.is_alive()
        assert await eventually_gone(host.pid)  # killed: its connection failed
        with contextlib.suppress(ConnectionClosed):
            await session.shutdown()
    finally:
        await provider.aclose()
