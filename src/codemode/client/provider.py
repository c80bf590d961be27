"""A session provider that shares one host connection and replaces it once it has died.

Every remote carrier (a host child process, a WebSocket host) gives sessions the same way: the
connection is made on first use (one attempt at a time), shared by every session while it lives,
and replaced by a fresh one on the next ``create_session`` after it died — dead sessions are never
revived (``protocol-v1.md`` §9.1, §9.8).
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Sequence
from typing import Generic, Protocol, Self, TypeVar

from codemode.client.v1 import RemoteSession, V1ClientConnection
from codemode.errors import CodeModeError
from codemode.protocol.types import CodeModeSessionCellExecutionLimits
from codemode.session import CodeModeSessionDelegate, CodeModeSessionProvider

__all__ = ["HostLink", "SharedConnectionProvider"]


class HostLink(Protocol):
    """One connection to a host and whatever carries it (a child process, sockets)."""

    @property
    def connection(self) -> V1ClientConnection: ...

    @property
    def finished(self) -> bool:
        """True once nothing of it is left to clean up."""
        ...

    def is_alive(self) -> bool: ...

    async def aclose(self, sessions: Sequence[RemoteSession] = ()) -> None:
        """Shut ``sessions`` down (bounded), then close the connection and its carrier."""
        ...


L = TypeVar("L", bound=HostLink)


class SharedConnectionProvider(CodeModeSessionProvider, Generic[L]):
    """Creates :class:`RemoteSession` objects on one shared link; subclasses make the link."""

    def __init__(self) -> None:
        self._link: L | None = None
        self._links: list[L] = []
        self._sessions: dict[L, list[RemoteSession]] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    @abstractmethod
    async def _connect(self) -> L:
        """Make a fresh link whose connection completed its handshake."""

    @property
    def link(self) -> L | None:
        """The current link, if one was made and is still alive."""
        link = self._link
        return link if link is not None and link.is_alive() else None

    async def create_session(self, delegate: CodeModeSessionDelegate) -> RemoteSession:
        """Open a session on the shared link (making it if needed)."""
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits,
    ) -> RemoteSession:
        """Open a session whose cells share ``limits`` (C7 if the host did not grant them)."""
        link = await self._current()
        session = await link.connection.open_session(delegate, limits)
        sessions = self._sessions.setdefault(link, [])
        sessions[:] = [s for s in sessions if s.is_alive()]
        sessions.append(session)
        return session

    async def _current(self) -> L:
        async with self._lock:
            if self._closed:
                raise CodeModeError("code-mode session provider is closed")
            link = self._link
            if link is not None and link.is_alive():
                return link
            self._link = None
            if link is not None:
                self._sessions.pop(link, None)
            link = await self._connect()
            self._link = link
            self._links = [old for old in self._links if not old.finished]
            self._links.append(link)
            return link

    async def aclose(self) -> None:
        """Shut down every session, then close every link."""
        async with self._lock:
            self._closed = True
            links, self._links, self._link = self._links, [], None
            sessions, self._sessions = self._sessions, {}
        await asyncio.gather(*(link.aclose(sessions.get(link, ())) for link in links))

    async def close(self) -> None:
        """The spec's name for :meth:`aclose` (§9.1)."""
        await self.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
