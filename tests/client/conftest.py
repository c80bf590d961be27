"""Fixtures of the client tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider


@pytest.fixture
async def provider() -> AsyncIterator[ProcessOwnedCodeModeSessionProvider]:
    """A provider that owns a ``codemode host --stdio`` child, closed after the test."""
    instance = ProcessOwnedCodeModeSessionProvider()
    try:
        yield instance
    finally:
        await instance.aclose()
