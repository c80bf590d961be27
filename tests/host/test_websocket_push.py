"""The WebSocket host and client read by push: a client's answer to a nested call settles the
call in the loop iteration that read it, with no task running (single socket and dual pair)."""

from __future__ import annotations

import asyncio

import pytest

from codemode.client.websocket import WebSocketCodeModeSessionProvider
from codemode.host import v1 as host_v1
from codemode.host.websocket import WebSocketAddress, WebSocketHost
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ExecuteRequest,
    InputText,
    Result,
    ToolDefinition,
    ToolName,
)
from codemode.protocol.delegation import CallbackResult
from codemode.runtime import LocalSessionProvider
from codemode.session import CancellationToken, CodeModeSessionDelegate

ECHO = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)
CALLS = 20


class Echo(CodeModeSessionDelegate):
    """Answers ``echo`` with its input, in its first step; notes who ran each call."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[object] | None] = []

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.tasks.append(asyncio.current_task())
        return invocation.input


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
async def test_answers_settle_nested_calls_where_they_are_read(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch, dual: bool
) -> None:
    settled_in_task: list[bool] = []
    original = host_v1._Settlement.set_result

    def set_result(self: host_v1._Settlement, result: CallbackResult) -> None:
        settled_in_task.append(asyncio.current_task() is not None)
        original(self, result)

    monkeypatch.setattr(host_v1._Settlement, "set_result", set_result)
    host = WebSocketHost(provider, WebSocketAddress("127.0.0.1", 0), dual=True)
    url = await host.start()
    client = WebSocketCodeModeSessionProvider(url, dual=dual)
    try:
        delegate = Echo()
        session = await client.create_session(delegate)
        source = (
            f"let sum = 0; for (let i = 0; i < {CALLS}; i++) sum += await tools.echo(i);"
            " text(String(sum));"
        )
        started = await session.execute(ExecuteRequest("push", source, [ECHO]))
        response = await started.initial_response()
        assert isinstance(response, Result), response
        assert response.error_text is None, response.error_text
        assert response.content_items == [InputText(str(sum(range(CALLS))))]
        assert len(delegate.tasks) == CALLS
        # Every answer was decoded in the socket's data_received: no reader task was running.
        assert settled_in_task == [False] * CALLS
        await session.shutdown()
    finally:
        await client.aclose()
        await host.aclose()
