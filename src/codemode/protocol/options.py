"""Checks of the option values users give providers, hosts and clients: a wrong value is a
:class:`ValueError` naming the option when the object is made, not a hang or a surprise later."""

from __future__ import annotations

import math

__all__ = ["checked_count", "checked_seconds"]


def checked_seconds(name: str, value: float, *, zero: bool = False) -> float:
    """``value`` if it is a finite number of seconds above 0 (``zero``: from 0 up), else
    :class:`ValueError` naming the option ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        least = "a non-negative" if zero else "a positive"
        raise ValueError(f"{name} must be {least} finite number of seconds, not {value!r}")
    return float(value)


def checked_count(name: str, value: int, *, minimum: int = 1) -> int:
    """``value`` if it is an integer of at least ``minimum``, else :class:`ValueError` naming
    the option ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}, not {value!r}")
    return value
