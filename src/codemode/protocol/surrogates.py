"""Text that UTF-8 can carry: lone surrogates replaced."""

from __future__ import annotations

__all__ = ["well_formed"]


def well_formed(text: str) -> str:
    """``text`` with each lone surrogate as U+FFFD (a pair split in two joined again).

    Python strings may hold lone surrogates (JSON decoders hand ``"\\ud800"`` escapes through,
    undecodable file names arrive as surrogates); UTF-8, and so every frame, the engine and the
    model's API, cannot carry them.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text
