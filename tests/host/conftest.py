"""What the host tests share: the embedded runtime they serve."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from codemode.runtime import LocalSessionProvider


@pytest.fixture
async def provider() -> AsyncIterator[LocalSessionProvider]:
    """The embedded runtime, closed after the test."""
    async with LocalSessionProvider() as instance:
        yield instance
