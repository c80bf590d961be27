"""Waiting, in tests, for what a host or a runtime does on its own time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from codemode.runtime import LocalSessionProvider


async def eventually(
    condition: Callable[[], object], timeout: float = 5.0, step: float = 0.01
) -> float:
    """Wait until ``condition()`` is true; returns how long it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        if loop.time() - start > timeout:
            raise AssertionError("the condition did not become true in time")
        await asyncio.sleep(step)
    return loop.time() - start


def live_cells(provider: LocalSessionProvider) -> list[str]:
    """The ids of the cells not yet closed in all of ``provider``'s sessions, sorted."""
    return sorted(str(cell_id) for session in provider._sessions for cell_id in session._cells)
