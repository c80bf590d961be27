"""Fixtures of the embedded runtime's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from codemode.runtime import LocalSessionProvider


@pytest.fixture
async def provider() -> AsyncIterator[LocalSessionProvider]:
    """A fresh embedded provider, closed after the test."""
    async with LocalSessionProvider() as instance:
        yield instance
