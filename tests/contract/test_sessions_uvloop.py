"""The session contract on uvloop: every test of ``test_sessions.py``, embedded and over stdio
(client and ``codemode host --stdio --loop uvloop`` both on uvloop; see ``conftest.py``).

The other carriers add no loop-specific code of ours (WebSocket and gRPC run on their libraries'
own loop integration); ``CODEMODE_TEST_LOOP=uvloop`` runs the whole contract suite on uvloop.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("uvloop", reason="uvloop is not installed (pip install 'codemode[fast]')")

from tests.contract.conftest import Harness, StdioHarness
from tests.contract.test_sessions import *  # noqa: F403

pytestmark = pytest.mark.parametrize("harness", ["embedded", "stdio"], indirect=True)


async def test_runs_on_uvloop(harness: Harness) -> None:
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    if isinstance(harness, StdioHarness):  # its host child too
        assert harness.command(True)[5:7] == ["--loop", "uvloop"]
