"""The one contract suite: every session implementation must pass the same behavioural tests.

A ``Harness`` opens sessions of one implementation (embedded today; stdio, WebSocket and gRPC
carriers join the ``IMPLEMENTATIONS`` list as they land) and cleans them up afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Protocol

import pytest

from codemode.protocol import (
    CodeModeSession,
    CodeModeSessionCellExecutionLimits,
    CodeModeSessionDelegate,
)
from codemode.protocol.constants import MAX_PENDING_DELEGATE_CALLS
from tests.contract.delegate import RecordingDelegate


class Harness(Protocol):
    """Opens sessions of one implementation."""

    name: str
    #: How many callbacks may be unresolved at once (``None``: no limit).
    max_pending_callbacks: int | None

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
    # The embedded runtime bounds unresolved callbacks per session the same way.
    max_pending_callbacks: int | None = MAX_PENDING_DELEGATE_CALLS

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


class StdioHarness:
    """Sessions on a real ``codemode host --stdio`` child, through the V1 client."""

    name = "stdio"
    # The host's limit of unresolved callbacks per connection (protocol-v1.md §8.6).
    max_pending_callbacks: int | None = MAX_PENDING_DELEGATE_CALLS

    def __init__(self) -> None:
        from codemode.client import ProcessOwnedCodeModeSessionProvider

        self._providers: dict[bool, ProcessOwnedCodeModeSessionProvider] = {}
        self._sessions: list[CodeModeSession] = []

    async def session(
        self,
        delegate: CodeModeSessionDelegate | None = None,
        *,
        limits: CodeModeSessionCellExecutionLimits | None = None,
        store_load: bool = True,
    ) -> CodeModeSession:
        from codemode.client import ProcessOwnedCodeModeSessionProvider

        provider = self._providers.get(store_load)
        if provider is None:
            command = [sys.executable, "-m", "codemode", "host", "--stdio"]
            if not store_load:
                command.append("--no-store-load")
            provider = self._providers[store_load] = ProcessOwnedCodeModeSessionProvider(command)
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


IMPLEMENTATIONS: dict[str, type[Harness]] = {"embedded": EmbeddedHarness, "stdio": StdioHarness}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """One harness per session implementation."""
    instance: Harness = IMPLEMENTATIONS[request.param]()
    try:
        yield instance
    finally:
        await instance.aclose()
