"""Unicode White_Space, the protocol's notion of "blank" and "trim" (``protocol-v1.md`` §2.5).

Python's ``str.isspace`` also counts U+001C..U+001F; the protocol does not, so these helpers never
use it.
"""

from __future__ import annotations

from typing import Final

WHITE_SPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)

#: A regular expression that matches one character that is not White_Space.
NON_BLANK_PATTERN: Final = (
    "[^\\t-\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"
)


def is_blank(value: str) -> bool:
    """True when ``value`` has no character outside Unicode White_Space."""
    return not value.strip(WHITE_SPACE)


def trim(value: str) -> str:
    """Strip Unicode White_Space from both ends."""
    return value.strip(WHITE_SPACE)


def trim_start(value: str) -> str:
    """Strip Unicode White_Space from the start."""
    return value.lstrip(WHITE_SPACE)
