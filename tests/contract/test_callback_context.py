"""A cell's callbacks run in the context of the ``execute`` that started it, on every carrier.

Tools of a server often read context variables (the request's user, its trace span). Before, a
tool saw the context of whatever had started the engine process or the connection's reader: on a
multi-tenant host, another request's.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field

from codemode.protocol import JSON, CellId, CodeModeNestedToolCall
from codemode.session import CancellationToken
from tests.contract.conftest import Harness
from tests.contract.delegate import RecordingDelegate
from tests.contract.helpers import items, run

REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("REQUEST", default="none")


@dataclass
class ContextDelegate(RecordingDelegate):
    """Records the ``REQUEST`` each callback sees, by cell; each callback then changes it."""

    seen: list[tuple[str, str, str]] = field(default_factory=list)

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.seen.append(("tool", invocation.cell_id.value, REQUEST.get()))
        REQUEST.set("set by a tool")  # must reach neither the caller nor another callback
        return await super().invoke_tool(invocation, cancellation)

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        self.seen.append(("notify", cell_id.value, REQUEST.get()))
        REQUEST.set("set by notify")
        await super().notify(call_id, cell_id, text, cancellation)

    def cell_closed(self, cell_id: CellId) -> None:
        self.seen.append(("closed", cell_id.value, REQUEST.get()))
        super().cell_closed(cell_id)


async def test_callbacks_see_the_context_of_their_cells_execute(harness: Harness) -> None:
    delegate = ContextDelegate()
    session = await harness.session(delegate)  # opened in a context where REQUEST is "none"
    source = 'await tools.echo({}); notify("n"); await tools.echo({}); text("ok")'

    async def request(name: str) -> str:
        REQUEST.set(name)
        result = await run(session, source)
        assert result.content_items == items("ok")
        assert REQUEST.get() == name  # nothing the callbacks set came back
        return result.cell_id.value

    cells = await asyncio.gather(request("alice"), request("bob"))
    deadline = asyncio.get_running_loop().time() + 5
    while len(delegate.closed) < 2:
        assert asyncio.get_running_loop().time() < deadline, "cells not closed"
        await asyncio.sleep(0.01)
    for cell, name in zip(cells, ["alice", "bob"], strict=True):
        seen = sorted((kind, value) for kind, cell_id, value in delegate.seen if cell_id == cell)
        assert seen == [("closed", name), ("notify", name), ("tool", name), ("tool", name)]
    assert REQUEST.get() == "none"
