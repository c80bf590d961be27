"""Layer 3: an engine process holds nothing of its parent's but its pipes, on either event loop.

asyncio's spawn closes every other descriptor; uvloop's does not, so the engine's start marks them
close-on-exec in the child. A descriptor the embedding program made inheritable (a socket, a file)
must not reach the process that runs cells.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from codemode.protocol import CellId, ExecuteRequest, InputText, Result
from codemode.runtime import LocalSessionProvider
from codemode.session import NoopCodeModeSessionDelegate


def _uvloop_run(main: Coroutine[Any, Any, int]) -> int:
    import uvloop

    result: int = uvloop.run(main)
    return result


LOOPS: dict[str, Callable[[Coroutine[Any, Any, int]], int]] = {"asyncio": asyncio.run}
if importlib.util.find_spec("uvloop") is not None:
    LOOPS["uvloop"] = _uvloop_run


async def engine_descriptor_targets() -> int:
    """Start an engine with an inheritable pipe open here; how many of its fds point at it."""
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    os.set_inheritable(write_end, True)
    ours = {os.readlink(f"/proc/self/fd/{fd}") for fd in (read_end, write_end)}
    try:
        async with LocalSessionProvider() as provider:
            session = await provider.create_session(NoopCodeModeSessionDelegate())
            started = await session.execute(ExecuteRequest("c", "text(1)"))
            assert await started.initial_response() == Result(CellId("1"), [InputText("1")])
            engine = session.engine
            assert engine is not None and engine.pid is not None
            directory = f"/proc/{engine.pid}/fd"
            targets = {os.readlink(f"{directory}/{name}") for name in os.listdir(directory)}
            return len(targets & ours)
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_an_inheritable_descriptor_of_ours_does_not_reach_the_engine(loop: str) -> None:
    assert LOOPS[loop](engine_descriptor_targets()) == 0
