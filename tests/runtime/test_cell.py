"""A cell's life as its logs tell it (one record when it starts, one when it ends), and how it
counts the values of a tool input."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codemode.protocol import CellId, ExecuteRequest, Result
from codemode.runtime import LocalSessionProvider
from codemode.runtime.cell import _json_counts
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


def _values(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(1 + _values(item) for item in value.values())
    if isinstance(value, list):
        return 1 + sum(_values(item) for item in value)
    return 1


def _containers(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_containers(item) for item in value.values())
    if isinstance(value, list):
        return 1 + sum(_containers(item) for item in value)
    return 0


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=40,
)
_ANY: int = 1 << 30


@given(_JSON, st.booleans())
def test_the_values_of_a_tool_input_are_never_undercounted(value: object, compact: bool) -> None:
    text = json.dumps(value, separators=(",", ":") if compact else None)
    actual, containers = _values(value), _containers(value)
    assert _json_counts(text, _ANY, _ANY)[0] >= actual
    assert _json_counts(text, _ANY, _ANY)[1] >= containers
    # Past the separators' count, strings are taken out: then only an empty container counts
    # one value too many, and containers are exact.
    assert _json_counts(text, actual - 1, _ANY)[0] > actual - 1
    assert _json_counts(text, 2 * actual, _ANY)[0] <= 2 * actual
    assert _json_counts(text, _ANY, containers - 1) == _json_counts(text, _ANY, -1)
    assert _json_counts(text, _ANY, -1)[1] == containers
