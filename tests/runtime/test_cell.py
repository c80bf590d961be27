"""A cell's life as its logs tell it: one record when it starts, one when it ends."""

from __future__ import annotations

import logging

import pytest

from codemode.protocol import CellId, ExecuteRequest, Result
from codemode.runtime import LocalSessionProvider
from codemode.session import NoopCodeModeSessionDelegate


@pytest.mark.timeout(60)
async def test_cells_log_their_start_and_their_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="codemode.cells")
    async with LocalSessionProvider() as provider:
        session = await provider.create_session(NoopCodeModeSessionDelegate())
        done = await session.execute(ExecuteRequest("call-1", 'text("hi")'))
        assert isinstance(await done.initial_response(), Result)
        failed = await session.execute(ExecuteRequest("call-2", 'throw new Error("no")'))
        await failed.initial_response()
        running = await session.execute(
            ExecuteRequest("call-3", "await new Promise(() => {})", yield_time_ms=10)
        )
        await running.initial_response()
        await session.terminate(CellId("3"))
        await session.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "codemode.cells"]
    assert "event=cell-start cell=1 call=call-1 tools=0" in lines
    ends = {line.split()[1]: line.split()[-1] for line in lines if "cell-end" in line}
    assert ends == {
        "cell=1": "outcome=completed",
        "cell=2": "outcome=failed",
        "cell=3": "outcome=terminated",
    }
