"""What the host tests share: the embedded runtime they serve, and a gRPC host serving it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from codemode.host.grpc import GrpcHost
from codemode.runtime import LocalSessionProvider


@pytest.fixture
async def provider() -> AsyncIterator[LocalSessionProvider]:
    """The embedded runtime, closed after the test."""
    async with LocalSessionProvider() as instance:
        yield instance


@pytest.fixture
async def grpc_host(provider: LocalSessionProvider) -> AsyncIterator[GrpcHost]:
    """A gRPC host of ``provider`` on a free loopback port, closed after the test."""
    host = GrpcHost(provider, "grpc://127.0.0.1:0")
    await host.start()
    try:
        yield host
    finally:
        await host.aclose()
