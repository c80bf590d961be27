"""A scripted fake host for client tests: raw frames over an in-memory pair, driven by the test."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from codemode.client import V1ClientConnection, connect_v1
from codemode.errors import CodeModeError
from codemode.protocol import CancellationToken, CellId, CodeModeNestedToolCall
from codemode.protocol.constants import SESSION_RESOURCE_LIMITS_CAPABILITY
from codemode.protocol.session import CodeModeSessionDelegate
from codemode.protocol.v1.codec import MessageDecoder, encode_frame
from codemode.protocol.v1.lanes import Lane
from codemode.protocol.v1.messages import (
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    HostToClient,
)
from codemode.transports import MemoryChannel, StreamTransport, memory_pair

_DECODER: MessageDecoder[ClientToHost] = MessageDecoder(ClientToHost)


class FakeHost:
    """The host end of an in-memory pair: reads client frames, writes whatever the test says."""

    def __init__(
        self,
        transport: StreamTransport,
        to_host: MemoryChannel,
        to_client: MemoryChannel,
    ) -> None:
        self.transport = transport
        self.to_host = to_host
        self.to_client = to_client

    async def receive(self, timeout: float = 2.0) -> ClientToHost:
        """The next client message (fails the test after ``timeout``)."""
        async with asyncio.timeout(timeout):
            item = await self.transport.receive()
        assert item is not None, "the client closed the connection"
        return _DECODER.decode(item[0])

    async def nothing(self, delay: float = 0.05) -> None:
        """Assert that the client sends nothing for ``delay`` seconds."""
        try:
            async with asyncio.timeout(delay):
                item = await self.transport.receive()
        except TimeoutError:
            return
        raise AssertionError(f"unexpected frame {item!r}")

    def send(self, *messages: HostToClient) -> None:
        """Write messages to the client."""
        for message in messages:
            self.transport.send(encode_frame(message))

    def close(self) -> None:
        """End the host → client stream (the client sees EOF)."""
        self.to_client.close()

    async def handshake(self, capabilities: tuple[str, ...] = ()) -> ConnectionHello:
        """Answer the client's hello with ``connection/ready``."""
        hello = await self.receive()
        assert isinstance(hello, ConnectionHello)
        self.send(ConnectionReady(1, capabilities))
        return hello


async def connected(
    capabilities: tuple[str, ...] = (SESSION_RESOURCE_LIMITS_CAPABILITY,),
) -> tuple[V1ClientConnection, FakeHost]:
    """A client connection whose handshake with a fake host succeeded."""
    client_end, host_end, to_host, to_client = memory_pair()
    host = FakeHost(host_end, to_host, to_client)
    task = asyncio.create_task(connect_v1(client_end))
    await host.handshake(capabilities)
    return await task, host


@dataclass
class ScriptedDelegate(CodeModeSessionDelegate):
    """A delegate whose behaviour per tool name is a function of the input and the token."""

    behaviour: dict[str, Callable[[Any, CancellationToken], Any]] = field(default_factory=dict)
    tokens: list[CancellationToken] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    notify_error: BaseException | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> Any:
        self.tokens.append(cancellation)
        handler = self.behaviour.get(invocation.tool_name.name)
        if handler is None:
            raise CodeModeError(f"no tool {invocation.tool_name.name}")
        result = handler(invocation.input, cancellation)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        self.tokens.append(cancellation)
        self.notes.append(text)
        if self.notify_error is not None:
            raise self.notify_error

    def cell_closed(self, cell_id: CellId) -> None:
        self.closed.append(str(cell_id))


__all__ = ["FakeHost", "Lane", "ScriptedDelegate", "connected"]
