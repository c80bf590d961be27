"""A delegate may answer a callback with a future instead of a coroutine, on every carrier.

A dispatcher of the caller's own (a queue, a worker, another connection) resolves the future
later; the carrier settles the nested call from its done callback, with no task per call. When
the cell ends first, the call's cancellation token fires, as for any delegate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from codemode.protocol import JSON, CellId, CodeModeNestedToolCall, LiveCell, Terminated
from codemode.session import CancellationToken, NoopCodeModeSessionDelegate
from tests.contract.conftest import Harness
from tests.contract.helpers import items, run, start


@dataclass
class Dispatcher(NoopCodeModeSessionDelegate):
    """Answers ``echo`` from a loop callback; ``hold`` keeps every call pending until its token
    fires (then the future is cancelled)."""

    hold: bool = False
    pending: list[tuple[asyncio.Future[JSON], CancellationToken]] = field(default_factory=list)

    def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> asyncio.Future[JSON]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[JSON] = loop.create_future()
        self.pending.append((future, cancellation))
        if self.hold:
            cancellation.add_callback(future.cancel)
        else:
            loop.call_soon(future.set_result, {"echoed": invocation.input})
        return future


async def test_futures_answer_nested_calls(harness: Harness) -> None:
    session = await harness.session(Dispatcher())
    source = "const r = await Promise.all([1, 2, 3].map((n) => tools.echo({ n })));"
    result = await run(session, source + " text(JSON.stringify(r))")
    expected = '[{"echoed":{"n":1}},{"echoed":{"n":2}},{"echoed":{"n":3}}]'
    assert result.content_items == items(expected)


async def test_a_terminated_cell_cancels_the_token_of_a_pending_future(harness: Harness) -> None:
    delegate = Dispatcher(hold=True)
    session = await harness.session(delegate)
    cell, _ = await start(session, 'text("calling"); await tools.echo({});', yield_ms=200)
    deadline = asyncio.get_running_loop().time() + 10
    while not delegate.pending:
        assert asyncio.get_running_loop().time() < deadline, "the call never came"
        await asyncio.sleep(0.01)
    outcome = await asyncio.wait_for(session.terminate(CellId(cell)), 5)
    assert outcome == LiveCell(Terminated(CellId(cell), []))
    future, token = delegate.pending[0]
    assert token.is_cancelled()
    assert future.cancelled()
