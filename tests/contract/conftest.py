"""The one contract suite: every session implementation must pass the same behavioural tests.

A ``Harness`` opens sessions of one implementation (embedded today; stdio, WebSocket and gRPC
carriers join the ``IMPLEMENTATIONS`` list as they land) and cleans them up afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import pytest

from codemode.protocol import (
    CodeModeSession,
    CodeModeSessionCellExecutionLimits,
    CodeModeSessionDelegate,
)
from tests.contract.delegate import RecordingDelegate


class Harness(Protocol):
    """Opens sessions of one implementation."""

    name: str

    async def session(
        self,
        delegate: CodeModeSessionDelegate | None = None,
        *,
        limits: CodeModeSessionCellExecutionLimits | None = None,
        store_load: bool = True,
    ) -> CodeModeSession: ...

    async def aclose(self) -> None: ...


class EmbeddedHarness:
    """Sessions of the in-process runtime."""

    name = "embedded"

    def __init__(self) -> None:
        from codemode.runtime import LocalSessionProvider

        self._providers: dict[bool, LocalSessionProvider] = {}
        self._sessions: list[CodeModeSession] = []

    async def session(
        self,
        delegate: CodeModeSessionDelegate | None = None,
        *,
        limits: CodeModeSessionCellExecutionLimits | None = None,
        store_load: bool = True,
    ) -> CodeModeSession:
        from codemode.runtime import LocalSessionProvider

        provider = self._providers.get(store_load)
        if provider is None:
            provider = self._providers[store_load] = LocalSessionProvider(store_load=store_load)
        session = await provider.create_session_with_limits(
            delegate or RecordingDelegate(), limits or CodeModeSessionCellExecutionLimits()
        )
        self._sessions.append(session)
        return session

    async def aclose(self) -> None:
        for session in self._sessions:
            await session.shutdown()
        for provider in self._providers.values():
            await provider.aclose()


IMPLEMENTATIONS = {"embedded": EmbeddedHarness}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """One harness per session implementation."""
    instance: Harness = IMPLEMENTATIONS[request.param]()
    try:
        yield instance
    finally:
        await instance.aclose()
