"""``codemode host --listen grpc+stdio://``: the gRPC service on the process's own pipes."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from codemode.client.grpc import GrpcCodeModeSessionProvider
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    ExecuteRequest,
    InputText,
    Result,
    ToolDefinition,
    ToolName,
)
from codemode.session import CancellationToken, CodeModeSessionDelegate

ECHO = ToolDefinition("echo", ToolName("echo"), "echo")


class Echo(CodeModeSessionDelegate):
    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        return {"echo": invocation.input}


@dataclass
class PipeHost:
    """A ``grpc+stdio://`` host child and a loopback port whose one connection is its pipes."""

    child: asyncio.subprocess.Process
    url: str
    first_bytes: bytearray


@pytest.fixture
async def pipe_host() -> AsyncIterator[PipeHost]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "codemode",
        "host",
        "--listen",
        "grpc+stdio://",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout
    first_bytes = bytearray()
    pumps: set[asyncio.Task[None]] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def up() -> None:
            while data := await reader.read(65536):
                stdin.write(data)
                await stdin.drain()
            stdin.close()  # the client left: so does the host's client

        async def down() -> None:
            while data := await stdout.read(65536):
                if len(first_bytes) < 64:
                    first_bytes.extend(data[:64])
                writer.write(data)
                await writer.drain()
            writer.close()

        for pump in (up(), down()):
            pumps.add(asyncio.create_task(pump))

    bridge = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = bridge.sockets[0].getsockname()[1]
    try:
        yield PipeHost(child, f"grpc://127.0.0.1:{port}", first_bytes)
    finally:
        bridge.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        if child.returncode is None:
            child.kill()
            await child.wait()


@pytest.mark.timeout(60)
async def test_cells_run_over_the_pipes_and_the_end_of_stdin_stops_the_host(
    pipe_host: PipeHost,
) -> None:
    provider = GrpcCodeModeSessionProvider(pipe_host.url)
    session = await provider.create_session(Echo())
    started = await session.execute(
        ExecuteRequest("c", 'store("k", 1); text(JSON.stringify(await tools.echo({a: 1})))', [ECHO])
    )
    assert await started.initial_response() == Result(CellId("1"), [InputText('{"echo":{"a":1}}')])
    again = await session.execute(ExecuteRequest("c", 'text(String(load("k")))'))
    assert await again.initial_response() == Result(CellId("2"), [InputText("1")])
    # stdout carries HTTP/2 only: the server's first frame is its SETTINGS (type 4, stream 0).
    assert pipe_host.first_bytes[3] == 4
    assert int.from_bytes(pipe_host.first_bytes[5:9], "big") == 0
    await provider.aclose()
    # grpc may keep the TCP connection a while after the channel closed: end stdin directly.
    assert pipe_host.child.stdin is not None
    pipe_host.child.stdin.close()
    assert await asyncio.wait_for(pipe_host.child.wait(), 20) == 0


@pytest.mark.timeout(60)
async def test_sigterm_stops_the_host(pipe_host: PipeHost) -> None:
    provider = GrpcCodeModeSessionProvider(pipe_host.url)
    session = await provider.create_session(Echo())
    started = await session.execute(ExecuteRequest("c", "text(1)"))
    await started.initial_response()
    pipe_host.child.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(pipe_host.child.wait(), 40) == 0
    with contextlib.suppress(Exception):
        await provider.aclose()


def test_grpc_stdio_refuses_network_options() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "codemode", "host", "--listen", "grpc+stdio://", "--tls-cert", "x"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert b"grpc+stdio:// serves the process's own pipes" in done.stderr
