"""A bounded memory of recently finished ids (``RECENT_ID_MEMORY``, ``protocol-v1.md`` §1.2)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from codemode.protocol.constants import RECENT_ID_MEMORY

__all__ = ["RecentIds"]

K = TypeVar("K", bound=Hashable)


class RecentIds(Generic[K]):
    """Remembers the last ``capacity`` ids added; the oldest is forgotten first."""

    __slots__ = ("_capacity", "_ids")

    def __init__(self, capacity: int = RECENT_ID_MEMORY) -> None:
        self._capacity = capacity
        self._ids: OrderedDict[K, None] = OrderedDict()

    def add(self, key: K) -> None:
        """Remember ``key`` (moving it to the newest position)."""
        self._ids[key] = None
        self._ids.move_to_end(key)
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)
