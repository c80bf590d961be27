"""The behavioural fixture of ``runtime.md`` §16: tools ``echo``, ``fail``, ``patch``, ``block``,
``hidden-dynamic-tool`` behind a delegate that applies the §4.4 input rules and records everything.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from codemode.errors import CodeModeError
from codemode.protocol import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ToolDefinition,
    ToolName,
)
from codemode.session import (
    CancellationToken,
    CodeModeSessionDelegate,
)


def function_tool(name: str, description: str = "") -> ToolDefinition:
    return ToolDefinition(name, ToolName.plain(name), description, CodeModeToolKind.FUNCTION)


def freeform_tool(name: str, description: str = "") -> ToolDefinition:
    return ToolDefinition(name, ToolName.plain(name), description, CodeModeToolKind.FREEFORM)


ECHO = function_tool("echo", "Echo tool")
FAIL = function_tool("fail", "Fail tool")
PATCH = freeform_tool("patch", "Patch tool")
BLOCK = function_tool("block", "Block tool")
HIDDEN = function_tool("hidden-dynamic-tool", "Hidden tool")
FIXTURE_TOOLS = [ECHO, FAIL, PATCH, BLOCK, HIDDEN]


@dataclass
class RecordingDelegate(CodeModeSessionDelegate):
    """Serves the fixture tools and records calls, notifications, cancellations and closes.

    ``notify_mode``: ``"return"`` (deliver at once), ``"wait_cancel"`` (block until cancelled),
    ``"ignore_cancel"`` (keep running ``notify_delay`` seconds even after cancellation),
    ``"delay"`` (take ``notify_delay`` seconds).
    """

    enabled: list[ToolDefinition] = field(default_factory=lambda: list(FIXTURE_TOOLS))
    notify_mode: str = "return"
    notify_delay: float = 0.2
    calls: list[CodeModeNestedToolCall] = field(default_factory=list)
    dispatched: list[tuple[str, JSON]] = field(default_factory=list)
    notifications: list[tuple[str, str, str]] = field(default_factory=list)
    notify_cancelled: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.calls.append(invocation)
        name = invocation.tool_name.name
        definition = next((t for t in self.enabled if t.name == name), None)
        if name == "exec":
            raise CodeModeError("exec cannot invoke itself")
        if definition is None:
            raise CodeModeError(f"tool `{name}` is not enabled in exec")
        arguments: Any = invocation.input
        if definition.kind is CodeModeToolKind.FUNCTION:
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, dict):
                raise CodeModeError(f"tool `{name}` expects a JSON object for arguments")
        elif not isinstance(arguments, str):
            raise CodeModeError(f"tool `{name}` expects a string input")
        self.dispatched.append((name, arguments))
        if name == "fail":
            raise CodeModeError("boom")
        if name == "patch":
            return "patched:" + arguments
        if name == "block":
            waiter = asyncio.ensure_future(self.release.wait())
            cancelled = asyncio.ensure_future(cancellation.wait_cancelled())
            await asyncio.wait({waiter, cancelled}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            cancelled.cancel()
            if cancellation.is_cancelled():
                self.cancelled.append(invocation.runtime_tool_call_id)
                self.events.append(f"cancelled:{invocation.runtime_tool_call_id}")
                raise CodeModeError("cancelled")
            return {"released": True}
        return arguments

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        self.notifications.append((call_id, str(cell_id), text))
        self.events.append(f"notify:{text}")
        if self.notify_mode == "wait_cancel":
            await cancellation.wait_cancelled()
            self.notify_cancelled.append(text)
            self.events.append(f"notify-cancelled:{text}")
        elif self.notify_mode == "ignore_cancel":
            await asyncio.sleep(self.notify_delay)
            if cancellation.is_cancelled():
                self.notify_cancelled.append(text)
        elif self.notify_mode == "delay":
            await asyncio.sleep(self.notify_delay)
            self.events.append(f"notified:{text}")

    def cell_closed(self, cell_id: CellId) -> None:
        self.closed.append(str(cell_id))
        self.events.append(f"closed:{cell_id}")
