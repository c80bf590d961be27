"""Host-wide bounds on what all sessions of one provider may make the host hold for their cells.

Each session bounds what its cells make this process keep (its store, output buffered for the
next observation, tool inputs and notification texts handed to the delegate and not yet settled),
and each engine process has a cap on its resident memory. Those bounds are per session, so a host
with many sessions had no bound at all: every session's cells at their bounds could take the
machine's memory. :class:`HeldCharacters` is shared by the sessions of a provider: each session
counts into it the characters it counts against its own bounds, and what would pass the shared
limit is refused as what would pass the session's own bound is, with a text that names the host.
:class:`ResidentMemory` is shared by a provider's engines: each engine's watchdog reports its
resident size, and when all of them together pass the limit the one that grew the most since
they were last within it is stopped (its cells end, as at its own cap).
"""

from __future__ import annotations

import os
from typing import Final

from codemode.protocol.options import checked_count

__all__ = [
    "HeldCharacters",
    "ResidentMemory",
    "default_held_chars",
    "default_max_engines",
    "physical_memory",
]

#: The share of the machine's physical memory the default limit is.
MEMORY_SHARE: Final = 4


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (``None`` where the system does not tell)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def default_held_chars(minimum: int) -> int:
    """A quarter of this machine's physical memory (as characters), at least ``minimum``."""
    memory = physical_memory()
    return minimum if memory is None else max(minimum, memory // MEMORY_SHARE)


#: What an idle engine process costs the machine, rounded up (measured: 12.5 MiB private,
#: 14 MiB proportional, after a trivial cell).
ENGINE_IDLE_BYTES: Final = 16 * 1024 * 1024


def default_max_engines(most: int, least: int) -> int:
    """As many engine processes as idle ones fit in a quarter of this machine's memory, within
    ``least`` and ``most`` (``most`` where the system does not tell)."""
    memory = physical_memory()
    if memory is None:
        return most
    return max(least, min(most, memory // MEMORY_SHARE // ENGINE_IDLE_BYTES))


class HeldCharacters:
    """A count of the characters held for cells against ``limit`` (``None``: no limit).

    Until the sessions together hold half the limit, any of them may take what is left; past
    that, a session may grow only to an equal share of the limit among the sessions that hold
    something. One session alone can use all of it, but once others hold characters too it
    cannot take the rest from them: what it holds stays (stores are committed data), its growth
    stops at its share.
    """

    __slots__ = ("chars", "holders", "limit")

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None:
            checked_count("max_held_chars", limit)
        self.limit = limit
        #: Characters held now (the sessions add and take back their own).
        self.chars = 0
        #: Sessions that hold at least one character now.
        self.holders = 0

    def room(self, own: int = 0) -> int:
        """How many more characters a session that holds ``own`` may add (a very large number
        when there is no limit; below zero when it is past its share)."""
        limit = self.limit
        if limit is None:
            return 1 << 62
        share = limit // (self.holders + (own == 0)) - own
        return min(limit - self.chars, max(limit // 2 - self.chars, share))

    def refusal(self, own: int = 0, size: int = 0) -> str:
        """The end of the text of what the limit refused: ``size`` more characters for a session
        that holds ``own``."""
        text = f"the host's limit of {self.limit} characters held for the cells of all its sessions"
        if self.limit is not None and size <= self.limit - self.chars:
            sessions = self.holders + (own == 0)
            return f"its session's share ({self.limit // sessions} characters, {sessions} sessions) of {text}"
        return text


class ResidentMemory:
    """The resident bytes of a provider's engine processes that run cells, against ``limit``
    (``None``: no limit). Engines report what their watchdogs read; when all of them together
    pass the limit, the engine that grew the most since they were last within it is named (an
    engine first seen past it counts all it holds): the one whose cells took the room, not a
    larger one that held steady — a cell must not get another session's engine stopped."""

    __slots__ = ("_base", "_engines", "limit", "total")

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None:
            checked_count("total_memory_cap_bytes", limit)
        self.limit = limit
        #: The sum of the last sizes reported (a running total: engines report 20 times a second).
        self.total = 0
        self._engines: dict[object, int] = {}
        self._base: dict[object, int] = {}  # each engine's size when last reported within it

    def report(self, engine: object, resident: int) -> object | None:
        """Record ``engine``'s resident bytes; the engine to stop if all together pass the limit."""
        self.total += resident - self._engines.get(engine, 0)
        self._engines[engine] = resident
        if self.limit is None or self.total <= self.limit:
            self._base[engine] = resident
            return None
        base = self._base
        return max(self._engines, key=lambda e: self._engines[e] - base.get(e, 0))

    def forget(self, engine: object) -> None:
        """``engine`` runs no cell (or has exited): it no longer counts."""
        self.total -= self._engines.pop(engine, 0)
        self._base.pop(engine, None)
