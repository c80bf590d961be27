"""The characters all sessions of one provider may hold in this process for their cells.

Each session bounds what its cells make the host keep: its store, output buffered for the next
observation, and tool inputs and notification texts handed to the delegate and not yet settled.
Those bounds are per session, so a host with many sessions had no bound at all: every session's
cells at their bounds could take the host process past its machine's memory. A
:class:`HeldCharacters` is shared by the sessions of a provider; each session counts the same
characters into it that it counts against its own bounds, and what would pass the shared limit
is refused as what would pass the session's own bound is, with a text that names the host.
"""

from __future__ import annotations

import os
from typing import Final

from codemode.protocol.options import checked_count

__all__ = ["HeldCharacters", "default_held_chars"]

#: The share of the machine's physical memory the default limit is.
MEMORY_SHARE: Final = 4


def default_held_chars(minimum: int) -> int:
    """A quarter of this machine's physical memory (as characters), at least ``minimum``."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that tells
        return minimum
    return max(minimum, memory // MEMORY_SHARE)


class HeldCharacters:
    """A count of the characters held for cells against ``limit`` (``None``: no limit)."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None:
            checked_count("max_held_chars", limit)
        self.limit = limit
        #: Characters held now (the sessions add and take back their own).
        self.held = 0

    def room(self) -> int:
        """How many more characters fit (a very large number when there is no limit)."""
        if self.limit is None:
            return 1 << 62
        return self.limit - self.held

    def refusal(self) -> str:
        """The end of the text of whatever the limit refused."""
        return f"the host's limit of {self.limit} characters held for the cells of all its sessions"
