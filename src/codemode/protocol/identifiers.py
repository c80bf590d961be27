"""Tool name → JavaScript identifier on ``tools`` (``runtime.md`` §4.1)."""

from __future__ import annotations

__all__ = ["normalize_identifier"]


def normalize_identifier(name: str) -> str:
    """Keep ``_``, ``$``, ASCII letters (and ASCII digits after the first position); replace
    every other character with ``_``; an empty result is ``_``."""
    if name.isascii() and name.isidentifier():
        # An ASCII Python identifier is already a valid result.
        return name
    chars = []
    for index, char in enumerate(name):
        letter = char in "_$" or "a" <= char <= "z" or "A" <= char <= "Z"
        digit = index > 0 and "0" <= char <= "9"
        chars.append(char if letter or digit else "_")
    return "".join(chars) or "_"
