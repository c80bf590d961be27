"""A client connected to a raw fake host over an in-memory pair, and a scripted delegate."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from codemode.client import V1ClientConnection, connect_v1
from codemode.errors import CodeModeError
from codemode.protocol import CellId, CodeModeNestedToolCall
from codemode.protocol.constants import SESSION_RESOURCE_LIMITS_CAPABILITY
from codemode.protocol.deadlines import DEFAULT_RESPONSE_TIMEOUT
from codemode.session import CancellationToken, CodeModeSessionDelegate
from tests.wire import RawHost, raw_host


async def connected(
    capabilities: tuple[str, ...] = (SESSION_RESOURCE_LIMITS_CAPABILITY,),
    *,
    response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
) -> tuple[V1ClientConnection, RawHost]:
    """A client connection whose handshake with a raw fake host succeeded."""
    transport, host = raw_host()
    task = asyncio.create_task(connect_v1(transport, response_timeout=response_timeout))
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


__all__ = ["ScriptedDelegate", "connected"]
